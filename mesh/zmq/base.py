"""What both ends of :mod:`mesh.zmq` share: the socket-security hook, the heartbeat settings, and
the process-wide ZeroMQ context that ends created without one (and without security) run on.

Heartbeats (ZMTP PING/PONG, answered by libzmq's I/O thread, so a busy event loop does not miss
them): every connection, both ends, pings every ``interval_ms``; an end that hears nothing for
``timeout_ms`` after a ping closes the connection (the client's socket monitor then reports it:
see :mod:`mesh.zmq.client`), and a client asks its server to drop it after ``ttl_ms`` of silence.
A link that black-holes traffic without a reset is therefore noticed within
``interval_ms + timeout_ms`` (1.25 s by default) of the last byte heard, not at the TCP timeout.

Why one context: every ``zmq.Context`` starts its own I/O thread. A site agent holds a server and a
client; with a context each, a hop between them crossed two I/O threads besides the event loop's,
and on a 2-core host the three took turns: the round trip measured 1.4-1.5x that of the same ends
on one shared context (which is what a bare DEALER/ROUTER pair in one process uses). Ends given
``security`` share a context with the ends given the *same* security object (an agent's server and
client: a CURVE hop on two contexts measured 1.1x one on a single context), and with no other: a ZAP
handler (where CURVE keys are admitted) is bound per context.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import zmq
import zmq.asyncio

__all__ = ["DEFAULT_HEARTBEAT", "Heartbeat", "SharedContext", "SocketSecurity", "close_context", "dual_stack",
           "open_context"]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """ZMTP heartbeat and handshake limits of a mesh socket, in milliseconds."""

    interval_ms: int = 250    # ZMQ_HEARTBEAT_IVL: ping this often
    timeout_ms: int = 1000    # ZMQ_HEARTBEAT_TIMEOUT: silence after a ping that closes the connection
    ttl_ms: int = 2000        # ZMQ_HEARTBEAT_TTL: silence after which the peer drops us (0.1 s resolution)
    handshake_ms: int = 2000  # ZMQ_HANDSHAKE_IVL: a connection not through its handshake by then fails
    # ZMQ_RECONNECT_IVL: the first reconnect's wait, doubled each time up to reconnect_max_ms. Short: a peer
    # re-binding its listener (a CURVE re-key) is back within milliseconds, and libzmq's 100 ms default was
    # most of the time a rotation cost each link; a dead peer is still probed once a second within 5 tries
    reconnect_ms: int = 25
    reconnect_max_ms: int = 1000  # ZMQ_RECONNECT_IVL_MAX: back-off cap of reconnects (probes of a dead peer)
    # how long a request whose connection dropped waits for a new one to be re-sent over (at most half the
    # budget it has left; 0: it fails at the drop). Covers a peer re-binding its listener (a CURVE re-key):
    # its new key reaches us through its live record a few round trips later (mesh.zmq.client)
    redial_ms: int = 1000

    def __post_init__(self) -> None:
        limits = (self.interval_ms, self.timeout_ms, self.ttl_ms, self.handshake_ms, self.reconnect_ms,
                  self.reconnect_max_ms)
        if min(limits) <= 0 or self.redial_ms < 0:
            raise ValueError(f"heartbeat settings must be positive: {self}")

    @property
    def detect_s(self) -> float:
        """Upper bound on the time from the last byte heard to the connection being closed."""
        return (self.interval_ms + self.timeout_ms) / 1000.0

    def apply(self, sock: zmq.Socket[Any], *, client: bool) -> None:
        sock.setsockopt(zmq.HEARTBEAT_IVL, self.interval_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.timeout_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, self.handshake_ms)
        if client:
            sock.setsockopt(zmq.HEARTBEAT_TTL, self.ttl_ms)
            sock.setsockopt(zmq.RECONNECT_IVL, self.reconnect_ms)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, self.reconnect_max_ms)


DEFAULT_HEARTBEAT = Heartbeat()

_Ctx = TypeVar("_Ctx", bound="zmq.Context[Any]")


def dual_stack(ctx: _Ctx) -> _Ctx:
    """``ctx`` with IPv6 on for every socket it makes from now on: without ``ZMQ_IPV6`` libzmq
    refuses ``tcp://[::1]:port`` and never resolves a host name to an IPv6 address. IPv4 keeps
    working on such sockets (libzmq opens dual-stack ones)."""
    ctx.setsockopt(zmq.IPV6, 1)
    return ctx


class SocketSecurity(Protocol):
    """Where CURVE keys and the ZAP domain are applied to a socket before bind / connect, and who sent a
    message (:mod:`mesh.zmq.curve` is the implementation)."""

    def apply_server(self, sock: zmq.Socket[Any]) -> None: ...

    def release_server(self, sock: zmq.Socket[Any]) -> None:
        """``sock`` (given to ``apply_server``) is about to close."""

    def apply_client(self, sock: zmq.Socket[Any], server_key: bytes | None) -> None: ...

    def peer(self, frame: zmq.Frame) -> str | None:
        """The authenticated peer a received frame came from; None if it is not (or no longer) admitted."""


class SharedContext:
    """A reference-counted ``zmq.asyncio.Context``: the first :meth:`acquire` creates it, the last
    :meth:`release` destroys it (``linger=0``), so nothing outlives the ends that used it. A forked
    child never touches its parent's context (libzmq forbids it): it gets a fresh one."""

    _lock = threading.Lock()
    _ctx: zmq.asyncio.Context | None = None
    _users = 0
    _pid = 0

    @classmethod
    def acquire(cls) -> zmq.asyncio.Context:
        with cls._lock:
            if cls._ctx is None or cls._pid != os.getpid() or cls._ctx.closed:
                cls._ctx, cls._users, cls._pid = dual_stack(zmq.asyncio.Context()), 0, os.getpid()
            cls._users += 1
            return cls._ctx

    @classmethod
    def release(cls, ctx: zmq.asyncio.Context) -> None:
        with cls._lock:
            if ctx is not cls._ctx:  # a parent's (after fork) or one already replaced: not ours to count
                return
            cls._users -= 1
            if cls._users <= 0:
                cls._ctx, cls._users = None, 0
                ctx.destroy(linger=0)

    @classmethod
    def users(cls) -> int:
        """How many ends hold the shared context now (0 when there is none)."""
        with cls._lock:
            return cls._users if cls._ctx is not None and cls._pid == os.getpid() else 0


# id(security) -> (security, its context, users, pid): the security object is held so its id is not reused
_SECURED: dict[int, tuple[SocketSecurity, zmq.asyncio.Context, int, int]] = {}
_SECURED_LOCK = threading.Lock()


def open_context(security: SocketSecurity | None) -> zmq.asyncio.Context:
    """The context for an end created without one: the shared one, or the one of ends given the same
    ``security`` (made on first use)."""
    if security is None:
        return SharedContext.acquire()
    with _SECURED_LOCK:
        entry = _SECURED.get(id(security))
        if entry is None or entry[3] != os.getpid() or entry[1].closed:
            entry = (security, dual_stack(zmq.asyncio.Context()), 0, os.getpid())
        _SECURED[id(security)] = (security, entry[1], entry[2] + 1, entry[3])
        return entry[1]


def close_context(ctx: zmq.asyncio.Context, security: SocketSecurity | None) -> None:
    """Give back what :func:`open_context` gave (with the same ``security``)."""
    if security is None:
        SharedContext.release(ctx)
        return
    with _SECURED_LOCK:
        entry = _SECURED.get(id(security))
        if entry is None or entry[1] is not ctx:  # a parent's (after fork) or already gone
            return
        if entry[2] > 1:
            _SECURED[id(security)] = (security, ctx, entry[2] - 1, entry[3])
            return
        del _SECURED[id(security)]
    ctx.destroy(linger=0)
