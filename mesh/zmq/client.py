"""The client end of :mod:`mesh.zmq`: one ZeroMQ DEALER per peer, shared by every caller, with
many requests in flight per peer and replies matched to them by request id.

Every request has a deadline (an instant on this process's monotonic clock; the wire carries the
budget left, see :mod:`mesh.zmq.protocol`): a pending request fails with ``DeadlineExceeded`` when it
passes, and a peer's pending requests fail with ``PeerUnavailable`` when the peer is known dead
(``fail_peer``, or the socket monitor's disconnect / handshake-failure events, after the wait below):
a CURVE-rejected or vanished peer otherwise just stays silent.

Replies are bounded as the server bounds requests: each frame by ``MAXMSGSIZE``, each message by
:class:`mesh.zmq.bounded.BoundedReceiver` (``MAX_FRAMES`` frames, ``message_bytes_limit(max_bytes)`` bytes), so a
peer's reply of millions of empty frames is cut short without a ``zmq.Frame`` kept for each. A reply refused whole
(cut, or over a bound) whose header names a pending request fails that request at once with ``ProtocolError``; the
peer's other requests and its socket are untouched. Undecodable replies are logged per peer at most every 10 s.

Gray failures. Every connection carries ZMTP heartbeats (:class:`mesh.zmq.base.Heartbeat`), so a
peer that stops answering without a reset (a black-holed link, a frozen process) has its
connection closed by libzmq within ``interval + timeout`` (1.25 s by default) of the last byte
heard, and one that never completes its handshake is given up ``handshake_ms`` (2 s) after the
socket opened. Either way the endpoint is then marked *unreachable* here, locally: its pending
requests wait (below) or fail with ``PeerUnavailable``, new requests to it fail so at once, unsent,
and listeners (``add_reachability_listener``) hear of it so that routing can leave it out.
Its socket is replaced by a fresh one that only probes: libzmq reconnects it (after ``reconnect_ms``,
doubling up to ``reconnect_max_ms``) and the first completed handshake clears the mark. The old socket
goes because whatever it still queued would reach the peer late, with the budget it had when sent.
So the bound from the last byte heard to "unreachable" is 1.25 s for an established connection
and 2 s for a new one (plus an event-loop turn).

Re-sent, not lost. A peer re-binding its listener (a CURVE re-key, ``ZmqServer.rebind``) drops every
connection to it and answers nothing that was in flight. So what was pending on a connection that had
completed its handshake waits for the next socket to that peer (the probe, or one :meth:`redial` opens
with its new key) and is sent again once that one's handshake completes: at most ``Heartbeat.redial_ms``
and half the budget it had left, then ``PeerUnavailable`` (a dead peer's requests keep time for another
site; :mod:`mesh.zmq.calls`). Requests are inferences, idempotent: a peer that got the first copy computes
it twice; one answer arrives. A probe whose handshake fails asks ``server_key_for`` again and re-dials if
the key changed. ``attempt_ms`` counts from the send that reached a working connection.

The key to dial. ``server_key_for(endpoint, lost)`` names it; ``lost`` is the key of the connection that
just dropped or failed its handshake (None on a first dial), so a lookup that knows two keys the peer may
serve with (the one its live record publishes and the one its re-issued certificate binds) answers with
the other one: a peer that re-keyed is dialled with its new key at the next reconnect, without waiting for
its live record to say so, and one that has not is dialled back with the old one at the next failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mesh import clock
from mesh.backoff import Backoff
from mesh.errors import DeadlineExceeded, MeshError, PayloadTooLarge, PeerUnavailable, ProtocolError, RequestError
from mesh.lifecycle import Service, State
from mesh.log import get_logger, kv
from mesh.types import InferRequest, InferResponse, new_request_id
from mesh.zmq import protocol as wire
from mesh.zmq.base import DEFAULT_HEARTBEAT, Heartbeat, SocketSecurity, close_context, open_context
from mesh.zmq.bounded import BoundedReceiver
from mesh.zmq.calls import Call, Peer, arm, fail, forget, hold, resend
from mesh.zmq.curve import RateLimitedLog
from mesh.zmq.protocol_check import DECODE_ERRORS, DEFAULT_MAX_BYTES, MAX_HEADER_BYTES, MAX_ID_LEN
from mesh.zmq.pump import Pump, io_socket

__all__ = ["ReplyWait", "ZmqClient"]

log = get_logger("mesh.zmq")

_PEER_DEAD_EVENTS: dict[int, str] = {
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake failed (authentication)",
}
# libzmq ends a session whose handshake failed and never reconnects it (it does for a lost connection): a probe
# that met one is dialled again by us, after RETRY_FIRST_S doubling up to RETRY_MAX_S. Found with sites that learn
# each other's certificates through etcd: a site that dialled a peer before its certificate reached that peer was
# refused once and, left to libzmq, kept routing around the peer for as long as it ran
_HANDSHAKE_FAILED = frozenset({zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                               zmq.EVENT_HANDSHAKE_FAILED_AUTH})
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 5.0
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED
for _event in _PEER_DEAD_EVENTS:
    _MONITORED |= _event
_WRITABLE_POLL_S = 0.05  # re-check a full send queue this often even if no POLLOUT edge is seen



@dataclasses.dataclass(slots=True)
class ReplyWait:
    """What :meth:`ZmqClient.request` tells its caller of its own event loop's delay: ``lag_s``, from the
    moment the reply (or the attempt's timer) was handled to the moment the awaiting coroutine resumed,
    the time this process took to get to its answer (other callbacks ahead of it: a CPU quota's stall,
    TLS handshakes, other requests' work), which the peer and the path did not spend."""

    lag_s: float = 0.0


ReachabilityListener = Callable[[str, bool], None]
# (endpoint, key of the connection to it just lost or None) -> the peer's CURVE public key to dial
KeyLookup = Callable[[str, bytes | None], bytes | None]


class ZmqClient(Service):
    """One DEALER per peer endpoint, shared by every caller; replies dispatched by the peer's pump."""

    def __init__(self, *, ctx: zmq.asyncio.Context | None = None, security: SocketSecurity | None = None,
                 server_key_for: KeyLookup | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, heartbeat: Heartbeat = DEFAULT_HEARTBEAT) -> None:
        # None until the first peer opens: then the shared context, or its own when ``security`` is set
        self._given_ctx = ctx
        self._ctx: zmq.asyncio.Context | None = ctx
        self._security = security
        self._server_key_for = server_key_for
        self._max_bytes = max_bytes
        self._heartbeat = heartbeat
        self._peers: dict[str, Peer] = {}
        # endpoint -> monotonic instant it was marked unreachable (its socket only probes)
        self._down: dict[str, float] = {}
        self._retry_s: dict[str, Backoff] = {}  # endpoint -> the waits before its next dials after failed handshakes
        self._listeners: list[ReachabilityListener] = []
        self._dying: set[asyncio.Task[None]] = set()
        self._state = State.RUNNING  # usable from construction: peers open on first use
        self.late_replies = 0  # replies that came after their request timed out or was failed
        self.garbage = RateLimitedLog()  # undecodable replies, logged per peer at most every 10 s

    def connect(self, endpoint: str) -> None:
        """Open the connection to ``endpoint`` now rather than on the first request: over a WAN the
        TCP + ZMTP handshake costs several round trips, which the first queries would otherwise pay. A peer with
        no CURVE key known yet (its certificate not delivered yet) is left for later: a request to it says so."""
        if self._state is State.RUNNING and endpoint not in self._peers:
            with contextlib.suppress(PeerUnavailable):
                self._open_peer(endpoint)

    def add_reachability_listener(self, listener: ReachabilityListener) -> None:
        """Call ``listener(endpoint, unreachable)`` whenever an endpoint's mark changes: ``True``
        when it is marked unreachable, ``False`` when a probe's handshake (or ``fail_peer``) lifts it."""
        self._listeners.append(listener)

    def unreachable(self) -> dict[str, float]:
        """Endpoints marked unreachable now, with the monotonic instant each was marked."""
        return dict(self._down)

    def pending(self, endpoint: str) -> int:
        peer = self._peers.get(endpoint)
        return 0 if peer is None else len(peer.pending)

    async def request(self, endpoint: str, req: InferRequest, *, reserve_ms: float = 0.0,
                      attempt_ms: float | None = None, wait: ReplyWait | None = None) -> InferResponse:
        """Send ``req`` to ``endpoint`` and await its reply, until ``req.deadline`` at the latest.
        Sets ``req.request_id`` if empty. ``reserve_ms``: budget kept back from the peer (the
        receiver's deadline is its arrival plus what is left at send, less this). ``attempt_ms``: the
        reply must come within this of the send (the peer gets no more), else ``DeadlineExceeded``;
        a request re-sent over a new connection gets it again from then, never past ``req.deadline``.
        ``wait``: filled with this process's own delay in getting to the reply or error (:class:`ReplyWait`).

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
        since = self._down.get(endpoint)
        if since is not None:
            raise PeerUnavailable(f"{endpoint} unreachable for {now - since:.1f} s (no heartbeat); probing")
        if not req.request_id:
            req.request_id = new_request_id()
        size = 0
        for a in req.inputs.values():
            size += a.nbytes
        if size > self._max_bytes:  # the server would drop the connection, failing every pending call
            raise PayloadTooLarge(f"request tensors are {size} bytes, limit is {self._max_bytes}")
        peer = self._peers.get(endpoint) or self._open_peer(endpoint)
        pump = cast(Pump, peer.pump)
        rid = req_id = req.request_id
        if rid in peer.pending or len(rid) > MAX_ID_LEN:
            rid = new_request_id()
            req = dataclasses.replace(req, request_id=rid)
        call = Call(pump.loop.create_future(), req, reserve_ms, None if attempt_ms is None else attempt_ms / 1000.0,
                     peer)
        peer.pending[rid] = call
        try:
            if peer.redial and not peer.up:  # a re-dialled socket: sent with the requests it carries
                hold(call, now, "reconnecting", self._heartbeat.redial_ms / 1000.0)
            else:
                frames = arm(call, now)
                try:
                    pump.send(frames)
                except zmq.Again:  # only when the send queue is full: never wait past the reply's fate
                    await self._send_when_writable(peer, frames, call.fut)
                except zmq.ZMQError as exc:
                    raise PeerUnavailable(f"send to {endpoint} failed: {exc}") from exc
            resp = await call.fut
            resp.request_id = req_id
            return resp
        finally:
            forget(call)
            if wait is not None and call.settled:
                wait.lag_s = clock.monotonic() - call.settled

    async def _send_when_writable(self, peer: Peer, frames: list[Any], fut: asyncio.Future[Any]) -> None:
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
        (queued, unsent requests go with it), forgetting any unreachable mark (and its probe): the
        next request opens a fresh one. Returns how many requests failed."""
        peer = self._peers.get(endpoint)
        failed = 0 if peer is None else self._drop_peer(peer, reason)
        if self._down.pop(endpoint, None) is not None:
            self._notify(endpoint, False)
        return failed

    def redial(self, endpoint: str, reason: str, *, lost: bytes | None = None) -> int:
        """Replace the socket to ``endpoint`` by a fresh one (``server_key_for`` asked again: the peer's key
        changed), carrying its pending requests over: they are sent again once the new socket's handshake
        completes (see the module's "Re-sent, not lost"). An unreachable mark stays until then. ``lost``: the
        key the replaced socket failed with, if that is why (see the module's "The key to dial"). Returns how
        many requests it carries."""
        peer = self._peers.get(endpoint)
        if peer is None or self._state is not State.RUNNING:
            return 0
        calls = dict(peer.pending)
        peer.pending.clear()
        self._drop_peer(peer, reason)
        return len(calls) if self._reopen(endpoint, calls, reason, lost=lost) else 0

    def drop_idle(self) -> int:
        """Drop the sockets of peers with nothing pending (security settings changed: the next request opens
        a fresh one with them); busy ones are left to finish, and so are probes of unreachable peers (dropping
        one would leave a mark no handshake lifts; what it dials with stays admitted through a rotation's
        grace period). Returns how many were dropped."""
        idle = [p for p in self._peers.values() if not p.pending and p.endpoint not in self._down]
        for peer in idle:
            self._drop_peer(peer, "security settings changed")
        return len(idle)

    async def close(self) -> None:
        await self.stop()

    async def _stop(self) -> None:
        for peer in list(self._peers.values()):
            self._drop_peer(peer, "client closed")
        self._down.clear()
        await asyncio.gather(*self._dying, return_exceptions=True)
        ctx, self._ctx = self._ctx, self._given_ctx
        if ctx is not None and ctx is not self._given_ctx:
            close_context(ctx, self._security)

    # ------------------------------------------------------------ internals

    def _open_peer(self, endpoint: str, lost: bytes | None = None) -> Peer:
        if self._ctx is None:
            self._ctx = open_context(self._security)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes + MAX_HEADER_BYTES)
        self._heartbeat.apply(sock, client=True)
        monitor: zmq.asyncio.Socket | None = None
        key: bytes | None = None
        try:
            if self._security is not None:
                key = self._server_key_for(endpoint, lost) if self._server_key_for is not None else None
                self._security.apply_client(sock, key)
            # watch before connecting so no disconnect can slip past
            monitor = sock.get_monitor_socket(_MONITORED)
            sock.connect(endpoint)
        except BaseException as exc:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            if isinstance(exc, zmq.ZMQError):
                raise PeerUnavailable(f"cannot connect to {endpoint}: {exc}") from exc
            raise
        peer = Peer(endpoint, sock, cast(zmq.asyncio.Socket, monitor), key=key)
        # replies are read within the bounds of one message, as the server reads requests (a DEALER: no identity)
        receiver = BoundedReceiver.over(io_socket(sock), self._max_bytes, routed=False)
        peer.pump = Pump(receiver, lambda msg: self._on_reply(peer, msg), f"zmq client {endpoint}")
        peer.tasks = [asyncio.create_task(self._watch(peer), name=f"zmq-monitor {endpoint}")]
        if endpoint not in self._down:
            # a connection that never completes its handshake (a SYN or greeting lost in a black
            # hole) raises no monitor event of its own
            peer.watchdog = peer.pump.loop.call_later(self._heartbeat.handshake_ms / 1000.0,
                                                      self._handshake_overdue, peer)
        self._peers[endpoint] = peer
        return peer

    def _on_reply(self, peer: Peer, msg: list[zmq.Frame]) -> None:
        try:
            rid, out = wire.decode_reply(msg, max_bytes=self._max_bytes)
        except DECODE_ERRORS as exc:
            # a reply refused whole (cut short, too many frames or bytes) whose header still names a request of
            # ours fails that request now, not at its deadline; the peer's other requests are not touched
            named = wire.peek_request_id(msg)
            self.garbage.warn(peer.endpoint, "undecodable reply from %s: %s", peer.endpoint, exc.message,
                              request_id=named, reason=exc.code)
            if named is None or named not in peer.pending:
                return
            rid, out = named, ProtocolError(f"reply from {peer.endpoint} refused: {exc.message}")
        call = peer.pending.pop(rid, None)
        if call is None:
            self.late_replies += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("late reply from %s dropped", peer.endpoint, extra=kv(request_id=rid))
            return
        if call.timer is not None:
            call.timer.cancel()
        fut = call.fut
        if fut.done():
            return
        call.settled = clock.monotonic()
        if isinstance(out, MeshError):
            fut.set_exception(out)
        else:
            fut.set_result(out)

    async def _watch(self, peer: Peer) -> None:
        while True:
            try:
                event = parse_monitor_message(await peer.monitor.recv_multipart())
            except zmq.ZMQError:
                if peer.monitor.closed:
                    return
                continue
            code = int(event["event"])
            if code == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._mark_up(peer)
                continue
            reason = _PEER_DEAD_EVENTS.get(code)
            if reason is None:
                continue
            if peer.endpoint not in self._down:
                self._mark_down(peer, reason)
                return
            # a probe's failed attempt: libzmq tries again, unless the key to dial changed meanwhile or the
            # handshake failed (it ends that session for good): then a new socket, now or a little later
            if self._key_changed(peer):
                self.redial(peer.endpoint, f"{reason}; its server key changed", lost=peer.key)
                return
            if code in _HANDSHAKE_FAILED:
                self._retry_later(peer, reason)
                return

    def _retry_later(self, peer: Peer, reason: str) -> None:
        backoff = self._retry_s.get(peer.endpoint)
        if backoff is None:
            backoff = self._retry_s[peer.endpoint] = Backoff(RETRY_FIRST_S, RETRY_MAX_S)

        def again() -> None:
            peer.retry = None
            if self._peers.get(peer.endpoint) is peer and self._state is State.RUNNING:
                self.redial(peer.endpoint, f"{reason}; dialled again", lost=peer.key)

        peer.retry = peer.pump.loop.call_later(backoff.next(), again) if peer.pump else None

    def _handshake_overdue(self, peer: Peer) -> None:
        peer.watchdog = None
        if not peer.up and self._peers.get(peer.endpoint) is peer and peer.endpoint not in self._down:
            self._mark_down(peer, f"no handshake within {self._heartbeat.handshake_ms} ms")

    def _mark_up(self, peer: Peer) -> None:
        peer.up = True
        self._retry_s.pop(peer.endpoint, None)
        if peer.watchdog is not None:
            peer.watchdog.cancel()
            peer.watchdog = None
        since = self._down.pop(peer.endpoint, None)
        if since is not None:
            log.info("peer %s reachable again after %.1f s", peer.endpoint, clock.monotonic() - since)
        held = [c for c in peer.pending.values() if not c.sent]
        if held:
            resend(cast(Pump, peer.pump), held, clock.monotonic())
            log.info("re-sent %d request(s) to %s over a new connection", len(held), peer.endpoint)
        if since is not None:
            self._notify(peer.endpoint, False)

    def _mark_down(self, peer: Peer, reason: str) -> None:
        # requests sent over a connection that worked (or held already) wait for the probe; those queued on
        # one that never came up fail now: that peer was never reached
        calls = {rid: c for rid, c in peer.pending.items() if peer.up or not c.sent}
        for rid in calls:
            del peer.pending[rid]
        n = self._drop_peer(peer, reason)
        self._down[peer.endpoint] = clock.monotonic()
        log.warning("peer %s unreachable (%s): failed %d pending, %d wait to be re-sent; probing", peer.endpoint,
                    reason, n, len(calls))
        # the probe: libzmq reconnects it until a handshake succeeds
        if self._reopen(peer.endpoint, calls, reason, marked=False, lost=peer.key):
            self._notify(peer.endpoint, True)

    def _reopen(self, endpoint: str, calls: dict[str, Call], reason: str, *, marked: bool = True,
                lost: bytes | None = None) -> bool:
        """Open a fresh socket to ``endpoint`` (a probe if it is marked) and hand it ``calls`` to send once up.
        False (``calls`` failed) if it cannot be opened. ``marked``: listeners heard of its mark, if any;
        ``lost``: the key of the connection it replaces, if that one dropped or failed."""
        if self._state is not State.RUNNING:
            fail(calls.values(), f"{endpoint}: {reason}")
            return False
        try:
            peer = self._open_peer(endpoint, lost)
        except MeshError as exc:
            # nothing can dial it (e.g. its CURVE key went with its live record): forget the mark, so the
            # next request dials afresh and says why it cannot, instead of a mark no probe lifts
            fail(calls.values(), f"{endpoint}: {reason}; {exc.message}")
            if self._down.pop(endpoint, None) is not None and marked:
                self._notify(endpoint, False)
            log.warning("peer %s cannot be dialled (%s); its next request dials afresh", endpoint, exc)
            return False
        peer.redial = True
        now = clock.monotonic()
        for rid, call in calls.items():
            call.peer = peer
            peer.pending[rid] = call
            if call.sent:
                hold(call, now, reason, self._heartbeat.redial_ms / 1000.0)
        return True

    def _key_changed(self, peer: Peer) -> bool:
        if self._security is None or self._server_key_for is None:
            return False
        try:
            key = self._server_key_for(peer.endpoint, peer.key)
        except Exception:  # the lookup's bug must not stop the monitor
            log.exception("server key lookup failed for %s", peer.endpoint)
            return False
        return key is not None and key != peer.key

    def _notify(self, endpoint: str, unreachable: bool) -> None:
        for listener in self._listeners:
            try:
                listener(endpoint, unreachable)
            except Exception:  # a listener's bug must not stop the others or the monitor
                log.exception("reachability listener failed for %s", endpoint)

    def _drop_peer(self, peer: Peer, reason: str) -> int:
        if self._peers.get(peer.endpoint) is peer:
            del self._peers[peer.endpoint]
        if peer.watchdog is not None:
            peer.watchdog.cancel()
            peer.watchdog = None
        if peer.retry is not None:
            peer.retry.cancel()
            peer.retry = None
        if peer.pump is not None:
            peer.pump.close()  # before the socket closes: the pump's handle dies with it
        failed = fail(peer.pending.values(), f"{peer.endpoint}: {reason}")
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
