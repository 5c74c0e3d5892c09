"""The server end of :mod:`mesh.zmq`: a ZeroMQ ROUTER bound in front of a handler.

A request's deadline is set on arrival, on this process's monotonic clock, from the budget its
sender had left (:mod:`mesh.zmq.protocol`). Requests that arrive with none left are answered
without calling the handler; a request still in
flight when its deadline passes is cancelled and answered with ``DeadlineExceeded`` (unless
``enforce_deadline=False``); every handler failure becomes an error reply; past ``max_inflight``
requests the server answers ``Overloaded``. A caller always gets a ``MeshError`` subclass, never
silence. The ROUTER pings its clients too (:class:`mesh.zmq.base.Heartbeat`) and drops the
connection of one that stops answering.

Receive memory is bounded per peer: at most ``rcvhwm`` messages queued per connection (then TCP pushes back
on that peer alone), each frame at most ``max_bytes`` (or a header's bound; libzmq drops a peer that sends more),
and each message at most ``MAX_FRAMES`` frames and ``max_bytes`` plus a header in all: the socket is read through
:class:`mesh.zmq.bounded.BoundedReceiver`, which cuts a longer message short without keeping its frames, and the
decoder refuses it. (libzmq still holds a whole message before any of it is read: see :mod:`mesh.zmq.bounded`.)
Garbage is answered where it names a request id, and logged at most once per peer every 10 s (counted in
``garbage``). With ``security`` (:mod:`mesh.zmq.curve`), every request's sender must be an admitted peer:
the handler reads who it is with :func:`current_peer`; a sender no longer admitted (revoked) is refused.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self, cast

import zmq
import zmq.asyncio

from mesh import clock
from mesh.errors import DeadlineExceeded, MeshError, Overloaded, ProtocolError, Unauthenticated
from mesh.lifecycle import Service
from mesh.log import get_logger, kv
from mesh.types import InferRequest, InferResponse
from mesh.zmq import protocol as wire
from mesh.zmq.base import DEFAULT_HEARTBEAT, Heartbeat, SocketSecurity, close_context, open_context
from mesh.zmq.bounded import BoundedReceiver
from mesh.zmq.curve import RateLimitedLog
from mesh.zmq.protocol_check import DECODE_ERRORS, DEFAULT_MAX_BYTES, MAX_HEADER_BYTES
from mesh.zmq.pump import Pump, io_socket

__all__ = ["DEFAULT_RCVHWM", "Handler", "ZmqServer", "current_peer"]

log = get_logger("mesh.zmq")

Handler = Callable[[InferRequest], Awaitable[InferResponse]]
# messages queued per peer connection before libzmq stops reading it: with max_bytes, its memory bound
DEFAULT_RCVHWM = 256
_REBIND_LINGER_MS = 200  # a re-bound listener's old socket: answers queued at its close still go out
_PEER: contextvars.ContextVar[str | None] = contextvars.ContextVar("zmq_peer", default=None)


def current_peer() -> str | None:
    """Inside a handler: the authenticated peer (a site name, the ZAP ``User-Id``) that sent the request
    being handled; None on a server without security, or outside a handler."""
    return _PEER.get()


class ZmqServer(Service):
    """ROUTER bound on ``bind`` (port 0 picks a free one; ``endpoint`` says which)."""

    def __init__(self, handler: Handler, *, bind: str = "tcp://127.0.0.1:0",
                 ctx: zmq.asyncio.Context | None = None, security: SocketSecurity | None = None,
                 max_inflight: int = 1024, max_bytes: int = DEFAULT_MAX_BYTES,
                 enforce_deadline: bool = True, heartbeat: Heartbeat = DEFAULT_HEARTBEAT,
                 rcvhwm: int = DEFAULT_RCVHWM, arrival: Callable[[float], float] | None = None) -> None:
        self._handler = handler
        # when a request received now is charged from: the start of a stall of this process it may have waited
        # through (edge_agent.stall_watch), so a forward its sender gave up on during a freeze is not run on waking
        self._arrival = arrival
        self._bind = bind
        # None until start(): then the shared context, or one of its own when ``security`` is set
        self._given_ctx = ctx
        self._ctx: zmq.asyncio.Context | None = ctx
        self._security = security
        self._max_inflight = max_inflight
        self._max_bytes = max_bytes
        # False lets a handler answer after the deadline (tests of the client's late-reply path)
        self._enforce_deadline = enforce_deadline
        self._heartbeat = heartbeat
        self._rcvhwm = rcvhwm
        self.garbage = RateLimitedLog()  # bad frames and refused senders, logged per peer at most every 10 s
        self._sock: zmq.Socket[Any] | None = None
        self._pump: Pump | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._endpoint = ""

    @property
    def endpoint(self) -> str:
        self._require_running("its endpoint")
        return self._endpoint

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def _start(self) -> None:
        if self._ctx is None:
            self._ctx = open_context(self._security)
        try:
            sock = self._open_socket(self._bind)
        except Exception:
            self._release_context()
            raise
        self._sock = sock
        self._endpoint = cast(bytes, sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
        self._pump = Pump(self._receiver(sock), self._dispatch, f"zmq server {self._endpoint}")
        log.info("zmq server listening on %s", self._endpoint)

    async def rebind(self, *, drain_s: float = 1.0, retry_s: float = 3.0) -> None:
        """Open the listening socket again on the same endpoint, so that changed security settings (a site's
        re-issued CURVE key) hold for every connection: waits up to ``drain_s`` until no request is in flight
        (those arriving meanwhile included: the close would lose their answers), then closes the socket (its
        peers reconnect; answers still queued get ``_REBIND_LINGER_MS`` to leave) and binds anew (retried for
        ``retry_s`` while the old listener lets go of the port)."""
        self._require_running("rebind")
        assert self._ctx is not None and self._sock is not None and self._pump is not None
        give_up = time.monotonic() + drain_s
        while self._inflight:  # bounded: drain_s. Requests still arrive meanwhile: wait for those too
            left = give_up - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait(list(self._inflight), timeout=left)
        old, old_pump = self._sock, self._pump
        old_pump.close()
        old.close(linger=_REBIND_LINGER_MS)
        self._sock = self._pump = None  # until the new one is bound (a failed rebind leaves it stopped)
        give_up = time.monotonic() + retry_s
        try:
            while True:  # bounded: retry_s
                try:
                    sock = self._open_socket(self._endpoint)
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() > give_up:
                        raise
                    await asyncio.sleep(0.02)
        finally:
            # only now: the new socket already holds the context's ZAP handler, which must not be torn down
            if self._security is not None:
                self._security.release_server(old)
        self._sock = sock
        self._pump = Pump(self._receiver(sock), self._dispatch, f"zmq server {self._endpoint}")
        log.info("zmq server re-bound on %s", self._endpoint)

    def _receiver(self, sock: zmq.Socket[Any]) -> zmq.Socket[Any]:
        """What the pump reads: ``sock`` with the bounds of one message (frames and bytes) on every receive."""
        return BoundedReceiver.over(io_socket(sock), self._max_bytes, routed=True)

    def _open_socket(self, endpoint: str) -> zmq.Socket[Any]:
        assert self._ctx is not None
        sock: zmq.Socket[Any] | None = None
        try:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)  # a caller's own context may lack dual_stack(): tcp://[::1]:0 works
            # libzmq drops a peer that sends a frame over this, before we ever buffer it: no frame of a message
            # carries more than its header or its tensors' whole bound (the message's bound: BoundedReceiver)
            sock.setsockopt(zmq.MAXMSGSIZE, max(self._max_bytes, MAX_HEADER_BYTES))
            sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            self._heartbeat.apply(sock, client=False)
            if self._security is not None:
                self._security.apply_server(sock)
            sock.bind(endpoint)
        except Exception:
            if sock is not None:
                if self._security is not None:
                    self._security.release_server(sock)
                sock.close(linger=0)
            raise
        return sock

    async def _stop(self) -> None:
        if self._pump is not None:
            self._pump.close()
        tasks = list(self._inflight)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            if self._security is not None:
                self._security.release_server(self._sock)
            self._sock.close(linger=0)
        self._release_context()

    def _release_context(self) -> None:
        ctx, self._ctx = self._ctx, self._given_ctx
        if ctx is not None and ctx is not self._given_ctx:
            close_context(ctx, self._security)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _dispatch(self, msg: list[zmq.Frame]) -> None:
        ident, frames = msg[0], msg[1:]
        now = clock.monotonic()
        peer: str | None = None
        if self._security is not None and frames:
            # the ROUTER's identity frame carries no metadata: the peer's own frames do
            peer = self._security.peer(frames[0])
            if peer is None:
                rid = wire.peek_request_id(frames)
                self.garbage.warn(_who(frames[0]), "request from a peer not (or no longer) admitted",
                                  request_id=rid, reason="unauthenticated")
                if rid is not None:
                    self._reply(ident, wire.encode_error(rid, Unauthenticated(
                        "the sender is not an admitted site (revoked?)", reason="not_admitted")))
                return
        try:
            req = wire.decode_request(frames, max_bytes=self._max_bytes,
                                      now=now if self._arrival is None else self._arrival(now))
        except Exception as exc:  # hostile bytes: whatever a decoder raises is garbage
            # a decoder error other than a ProtocolError is a decoder bug; still the sender's bad input, and
            # logged at the garbage's rate, not once per message
            err = exc if isinstance(exc, DECODE_ERRORS) else ProtocolError(f"undecodable request: {exc!r}")
            rid = wire.peek_request_id(frames)
            self.garbage.warn(peer or _who(frames[0] if frames else ident), "bad request frames: %s",
                              err.message, request_id=rid, reason=err.code)
            if rid is not None:
                self._reply(ident, wire.encode_error(rid, err))
            return
        if req.deadline <= now:
            # the wall times are for whoever reads the log: skew and transit are not told apart
            self._reply(ident, wire.encode_error(req.request_id, DeadlineExceeded(
                f"request {req.request_id} arrived with no budget left ({req.remaining_ms(now):.1f} ms; "
                f"sent at {req.sent_at:.3f} by its sender's clock, received at {clock.wall():.3f} by ours)")))
            return
        if len(self._inflight) >= self._max_inflight:
            self._reply(ident, wire.encode_error(req.request_id, Overloaded(
                f"{len(self._inflight)} requests in flight at {self._endpoint}")))
            return
        task = asyncio.get_running_loop().create_task(self._handle(ident, req, peer))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _handle(self, ident: zmq.Frame, req: InferRequest, peer: str | None = None) -> None:
        if peer is not None:
            _PEER.set(peer)  # this task's own context: seen by the handler, nowhere else
        rid = req.request_id
        frames: list[Any]
        expired: list[bool] = []
        timer: asyncio.TimerHandle | None = None
        if self._enforce_deadline:
            # a hop that cannot meet the deadline answers with an error rather than late; one timer
            # that cancels this task is what asyncio.timeout does, at half its cost
            loop, task = asyncio.get_running_loop(), asyncio.current_task()
            assert task is not None
            timer = loop.call_at(loop.time() + max(0.0, req.deadline - clock.monotonic()), _expire_task, task,
                                 expired)
        try:
            resp = await self._handler(req)
            resp.request_id = rid  # replies are matched by id: never trust the handler to copy it
            frames = wire.encode_response(resp)
        except asyncio.CancelledError:
            if not expired:
                raise
            cast(asyncio.Task[None], asyncio.current_task()).uncancel()
            frames = wire.encode_error(rid, DeadlineExceeded(f"request {rid} not served before its deadline"))
        except MeshError as exc:  # before TimeoutError: DeadlineExceeded is one, and keeps its own code
            frames = wire.encode_error(rid, exc)
        except TimeoutError as exc:
            err = MeshError(f"internal error: handler timed out: {exc}") if self._enforce_deadline else \
                DeadlineExceeded(f"request {rid} not served before its deadline")
            frames = wire.encode_error(rid, err)
        except Exception as exc:
            log.exception("handler failed", extra=kv(request_id=rid, task=req.task, tenant=req.tenant))
            frames = wire.encode_error(rid, MeshError(f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            if timer is not None:
                timer.cancel()
        self._reply(ident, frames)

    def _reply(self, ident: zmq.Frame, frames: list[Any]) -> None:
        pump = self._pump
        if pump is None or not pump.open:
            return
        try:
            # a ROUTER never blocks on send (it drops for an unknown or full peer)
            pump.send([ident, *frames])
        except zmq.ZMQError as exc:  # a vanished peer: expected, not a crash
            log.debug("reply to a peer failed: %s", exc)


def _who(frame: zmq.Frame) -> str:
    """A name for the sender of ``frame`` in logs: its address (where the transport knows it)."""
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return "?"


def _expire_task(task: asyncio.Task[None], expired: list[bool]) -> None:
    if not task.done():
        expired.append(True)
        task.cancel()
