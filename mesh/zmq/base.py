"""What both ends of :mod:`mesh.zmq` share: the socket-security hook and
the process-wide ZeroMQ context that ends created without one (and without security) run on.

Why one context: every ``zmq.Context`` starts its own I/O thread. A site agent holds a server and a
client; with a context each, a hop between them crossed two I/O threads besides the event loop's,
and on a 2-core host the three took turns: the round trip measured 1.4-1.5x that of the same ends
on one shared context (which is what a bare DEALER/ROUTER pair in one process uses). Ends given
``security`` keep a context of their own: a ZAP handler (where CURVE keys are admitted) is bound
per context.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol, TypeVar

import zmq
import zmq.asyncio

__all__ = ["SharedContext", "SocketSecurity", "close_context", "dual_stack", "open_context"]

_Ctx = TypeVar("_Ctx", bound="zmq.Context[Any]")


def dual_stack(ctx: _Ctx) -> _Ctx:
    """``ctx`` with IPv6 on for every socket it makes from now on: without ``ZMQ_IPV6`` libzmq
    refuses ``tcp://[::1]:port`` and never resolves a host name to an IPv6 address. IPv4 keeps
    working on such sockets (libzmq opens dual-stack ones)."""
    ctx.setsockopt(zmq.IPV6, 1)
    return ctx


class SocketSecurity(Protocol):
    """Where CURVE keys and the ZAP domain are applied to a socket before bind / connect."""

    def apply_server(self, sock: zmq.Socket[Any]) -> None: ...

    def apply_client(self, sock: zmq.Socket[Any], server_key: bytes | None) -> None: ...


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


def open_context(security: SocketSecurity | None) -> zmq.asyncio.Context:
    """The context for an end created without one: the shared one, or its own if it is secured."""
    return SharedContext.acquire() if security is None else dual_stack(zmq.asyncio.Context())


def close_context(ctx: zmq.asyncio.Context, security: SocketSecurity | None) -> None:
    """Give back what :func:`open_context` gave (with the same ``security``)."""
    if security is None:
        SharedContext.release(ctx)
    else:
        ctx.destroy(linger=0)
