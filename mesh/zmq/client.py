"""The client end of :mod:`mesh.zmq`: one ZeroMQ DEALER per peer, shared by every caller, with
many requests in flight per peer and replies matched to them by request id.

Every request has a deadline (an instant on this process's monotonic clock; the wire carries the
budget left, see :mod:`mesh.zmq.protocol`): a pending request fails with ``DeadlineExceeded`` when it
passes, and all of a peer's pending requests fail with ``PeerUnavailable`` as soon as the peer is
known dead (``fail_peer``, or the socket monitor's disconnect / handshake-failure events): a
CURVE-rejected or vanished peer otherwise just stays silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mesh import clock
from mesh.errors import DeadlineExceeded, MeshError, PayloadTooLarge, PeerUnavailable, RequestError
from mesh.lifecycle import Service, State
from mesh.log import get_logger, kv
from mesh.types import InferRequest, InferResponse, new_request_id
from mesh.zmq import protocol as wire
from mesh.zmq.base import SocketSecurity, close_context, open_context
from mesh.zmq.protocol_check import DECODE_ERRORS, DEFAULT_MAX_BYTES, MAX_HEADER_BYTES, MAX_ID_LEN
from mesh.zmq.pump import Pump, io_socket

__all__ = ["ZmqClient"]

log = get_logger("mesh.zmq")

_PEER_DEAD_EVENTS: dict[int, str] = {
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake failed (authentication)",
}
_WRITABLE_POLL_S = 0.05  # re-check a full send queue this often even if no POLLOUT edge is seen


@dataclass(eq=False)
class _Peer:
    endpoint: str
    sock: zmq.Socket[Any]
    monitor: zmq.asyncio.Socket
    pump: Pump | None = None
    pending: dict[str, tuple[asyncio.Future[InferResponse], asyncio.TimerHandle]] = field(
        default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class ZmqClient(Service):
    """One DEALER per peer endpoint, shared by every caller; replies dispatched by the peer's pump."""

    def __init__(self, *, ctx: zmq.asyncio.Context | None = None, security: SocketSecurity | None = None,
                 server_key_for: Callable[[str], bytes | None] | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        # None until the first peer opens: then the shared context, or its own when ``security`` is set
        self._given_ctx = ctx
        self._ctx: zmq.asyncio.Context | None = ctx
        self._security = security
        self._server_key_for = server_key_for
        self._max_bytes = max_bytes
        self._peers: dict[str, _Peer] = {}
        self._dying: set[asyncio.Task[None]] = set()
        self._state = State.RUNNING  # usable from construction: peers open on first use
        self.late_replies = 0  # replies that came after their request timed out or was failed

    def connect(self, endpoint: str) -> None:
        """Open the connection to ``endpoint`` now rather than on the first request: over a WAN the
        TCP + ZMTP handshake costs several round trips, which the first queries would otherwise pay."""
        if self._state is State.RUNNING and endpoint not in self._peers:
            self._open_peer(endpoint)

    def pending(self, endpoint: str) -> int:
        peer = self._peers.get(endpoint)
        return 0 if peer is None else len(peer.pending)

    async def request(self, endpoint: str, req: InferRequest, *, reserve_ms: float = 0.0) -> InferResponse:
        """Send ``req`` to ``endpoint`` and await its reply, until ``req.deadline`` at the latest.
        Sets ``req.request_id`` if empty. ``reserve_ms``: budget kept back from the peer (the
        receiver's deadline is its arrival plus what is left at send, less this).

        The wire id is the request id, unless that id is already in flight to the same peer (two
        callers chose the same id) or too long for the wire: then a fresh one stands in for it and
        the reply still carries ``req.request_id``."""
        if self._state is not State.RUNNING:
            raise PeerUnavailable("zmq client is closed")
        if req.deadline <= 0:
            raise RequestError("request has no deadline")
        now = clock.monotonic()
        remaining = req.deadline - now
        if remaining <= 0:
            raise DeadlineExceeded(f"deadline passed {-remaining * 1000:.1f} ms before sending")
        if not req.request_id:
            req.request_id = new_request_id()
        size = 0
        for a in req.inputs.values():
            size += a.nbytes
        if size > self._max_bytes:  # the server would drop the connection, failing every pending call
            raise PayloadTooLarge(f"request tensors are {size} bytes, limit is {self._max_bytes}")
        peer = self._peers.get(endpoint) or self._open_peer(endpoint)
        pump = cast(Pump, peer.pump)
        rid = req.request_id
        if rid in peer.pending or len(rid) > MAX_ID_LEN:
            rid = new_request_id()
            frames = wire.encode_request(dataclasses.replace(req, request_id=rid), now=now, reserve_ms=reserve_ms)
        else:
            frames = wire.encode_request(req, now=now, reserve_ms=reserve_ms)
        loop = pump.loop
        fut: asyncio.Future[InferResponse] = loop.create_future()
        peer.pending[rid] = (fut, loop.call_at(loop.time() + remaining, self._expire, peer, rid))
        try:
            try:
                pump.send(frames)
            except zmq.Again:  # only when the send queue is full: never wait past the reply's fate
                await self._send_when_writable(peer, frames, fut)
            except zmq.ZMQError as exc:
                raise PeerUnavailable(f"send to {endpoint} failed: {exc}") from exc
            resp = await fut
            resp.request_id = req.request_id
            return resp
        finally:
            entry = peer.pending.pop(rid, None)
            if entry is not None:
                entry[1].cancel()

    async def _send_when_writable(self, peer: _Peer, frames: list[Any], fut: asyncio.Future[Any]) -> None:
        pump = cast(Pump, peer.pump)
        while not fut.done() and pump.open:
            await pump.wait_writable(_WRITABLE_POLL_S)
            if fut.done() or not pump.open:
                return
            try:
                pump.send(frames)
                return
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                raise PeerUnavailable(f"send to {peer.endpoint} failed: {exc}") from exc

    def fail_peer(self, endpoint: str, reason: str) -> int:
        """Fail every pending request to ``endpoint`` with ``PeerUnavailable`` now and drop its socket
        (queued, unsent requests go with it); the next request opens a fresh one. Returns how many."""
        peer = self._peers.get(endpoint)
        return 0 if peer is None else self._drop_peer(peer, reason)

    async def close(self) -> None:
        await self.stop()

    async def _stop(self) -> None:
        for peer in list(self._peers.values()):
            self._drop_peer(peer, "client closed")
        await asyncio.gather(*self._dying, return_exceptions=True)
        ctx, self._ctx = self._ctx, self._given_ctx
        if ctx is not None and ctx is not self._given_ctx:
            close_context(ctx, self._security)

    # ------------------------------------------------------------ internals

    def _open_peer(self, endpoint: str) -> _Peer:
        if self._ctx is None:
            self._ctx = open_context(self._security)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes + MAX_HEADER_BYTES)
        monitor: zmq.asyncio.Socket | None = None
        try:
            if self._security is not None:
                key = self._server_key_for(endpoint) if self._server_key_for is not None else None
                self._security.apply_client(sock, key)
            # watch before connecting so no disconnect can slip past
            monitor = sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            sock.connect(endpoint)
        except BaseException as exc:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            if isinstance(exc, zmq.ZMQError):
                raise PeerUnavailable(f"cannot connect to {endpoint}: {exc}") from exc
            raise
        peer = _Peer(endpoint, sock, cast(zmq.asyncio.Socket, monitor))
        peer.pump = Pump(io_socket(sock), lambda msg: self._on_reply(peer, msg), f"zmq client {endpoint}")
        peer.tasks = [asyncio.create_task(self._watch(peer), name=f"zmq-monitor {endpoint}")]
        self._peers[endpoint] = peer
        return peer

    def _on_reply(self, peer: _Peer, msg: list[zmq.Frame]) -> None:
        try:
            rid, out = wire.decode_reply(msg, max_bytes=self._max_bytes)
        except DECODE_ERRORS as exc:
            log.warning("undecodable reply from %s: %s", peer.endpoint, exc.message)
            return
        entry = peer.pending.pop(rid, None)
        if entry is None:
            self.late_replies += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("late reply from %s dropped", peer.endpoint, extra=kv(request_id=rid))
            return
        fut, timer = entry
        timer.cancel()
        if fut.done():
            return
        if isinstance(out, MeshError):
            fut.set_exception(out)
        else:
            fut.set_result(out)

    async def _watch(self, peer: _Peer) -> None:
        while True:
            try:
                event = parse_monitor_message(await peer.monitor.recv_multipart())
            except zmq.ZMQError:
                if peer.monitor.closed:
                    return
                continue
            reason = _PEER_DEAD_EVENTS.get(int(event["event"]))
            if reason is not None:
                n = self._drop_peer(peer, reason)
                log.info("peer %s %s: failed %d pending", peer.endpoint, reason, n)
                return

    def _expire(self, peer: _Peer, rid: str) -> None:
        entry = peer.pending.pop(rid, None)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(DeadlineExceeded(f"no reply from {peer.endpoint} before the deadline"))

    def _drop_peer(self, peer: _Peer, reason: str) -> int:
        if self._peers.get(peer.endpoint) is peer:
            del self._peers[peer.endpoint]
        if peer.pump is not None:
            peer.pump.close()  # before the socket closes: the pump's handle dies with it
        failed = 0
        for fut, timer in peer.pending.values():
            timer.cancel()
            if not fut.done():
                fut.set_exception(PeerUnavailable(f"{peer.endpoint}: {reason}"))
                failed += 1
        peer.pending.clear()
        current = asyncio.current_task()
        for t in peer.tasks:
            if t is not current and not t.done():
                t.cancel()
                self._dying.add(t)
                t.add_done_callback(self._dying.discard)
        with contextlib.suppress(zmq.ZMQError):
            peer.sock.disable_monitor()
        peer.monitor.close(linger=0)
        peer.sock.close(linger=0)
        return failed
