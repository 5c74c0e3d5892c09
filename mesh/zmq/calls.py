"""The client end's bookkeeping (:mod:`mesh.zmq.client`): one :class:`Peer` per endpoint's socket, one
:class:`Call` per request awaiting its reply there, and each call's one timer.

A call is *sent* over its peer's current socket, and its timer ends the wait at that send's deadline (the
request's, or the send plus the attempt's limit: ``DeadlineExceeded``); or it is *held* for the next socket (its
connection dropped, see "Re-sent, not lost" in :mod:`mesh.zmq.client`), and its timer gives up at most
``redial_s`` and half the budget it had left later (``PeerUnavailable``: time is left for another site).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from mesh import clock
from mesh.errors import DeadlineExceeded, PeerUnavailable
from mesh.types import InferRequest, InferResponse
from mesh.zmq import protocol as wire
from mesh.zmq.pump import Pump

__all__ = ["Call", "Peer", "arm", "fail", "forget", "hold", "resend"]


@dataclass(eq=False)
class Peer:
    endpoint: str
    sock: zmq.Socket[Any]
    monitor: zmq.asyncio.Socket
    pump: Pump | None = None
    pending: dict[str, Call] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    up: bool = False  # the current connection completed its handshake
    watchdog: asyncio.TimerHandle | None = None
    key: bytes | None = None  # the server key it dialled with (under security)
    redial: bool = False  # opened to carry the requests of a dropped connection: new ones wait for it too
    retry: asyncio.TimerHandle | None = None  # a probe whose handshake failed: dialled again then


@dataclass(eq=False, slots=True)
class Call:
    """One request awaiting its reply, with what it takes to send it again over a new connection."""

    fut: asyncio.Future[InferResponse]
    req: InferRequest              # as on the wire (its id is the wire id)
    reserve_ms: float
    attempt_s: float | None        # how long one send may go unanswered (None: until the deadline)
    peer: Peer                     # whose ``pending`` holds it now
    timer: asyncio.TimerHandle | None = None
    sent: bool = False             # over its peer's socket; False: held until that socket is up
    held: str = ""                 # why it waits for a new connection
    settled: float = 0.0           # monotonic instant its reply (or its timer's error) was handled; 0: not yet


def arm(call: Call, now: float) -> list[Any]:
    """``call``'s frames for a send at ``now``, its timer set to that send's deadline."""
    req = call.req
    deadline, reserve = req.deadline, call.reserve_ms
    if call.attempt_s is not None and now + call.attempt_s < deadline:
        deadline = now + call.attempt_s
        reserve += (req.deadline - deadline) * 1000.0  # the peer gets the attempt's budget, no more
    _set_timer(call, deadline - now)
    call.sent, call.held = True, ""
    return wire.encode_request(req, now=now, reserve_ms=reserve)


def hold(call: Call, now: float, reason: str, redial_s: float) -> None:
    """``call`` waits for the next connection: at most ``redial_s`` and half the budget it has left."""
    left = call.req.deadline - now
    call.sent, call.held = False, reason
    _set_timer(call, min(redial_s, left / 2) if left > 0 else 0.0)


def resend(pump: Pump, calls: list[Call], now: float) -> None:
    """Send the held ``calls`` over ``pump``'s socket (its handshake just completed)."""
    for call in calls:
        if call.fut.done():
            continue
        try:
            pump.send(arm(call, now))
        except zmq.ZMQError as exc:  # a full send queue included: rare on a fresh socket
            forget(call)
            call.fut.set_exception(PeerUnavailable(f"re-send to {call.peer.endpoint} failed: {exc}"))


def forget(call: Call) -> None:
    """``call`` is answered or abandoned: off its peer's books, its timer cancelled."""
    pending = call.peer.pending
    if pending.get(call.req.request_id) is call:
        del pending[call.req.request_id]
    if call.timer is not None:
        call.timer.cancel()


def fail(calls: Any, why: str) -> int:
    """Fail every call of ``calls`` not answered yet with ``PeerUnavailable(why)``; returns how many."""
    failed = 0
    for call in list(calls):
        if call.timer is not None:
            call.timer.cancel()
        if not call.fut.done():
            call.fut.set_exception(PeerUnavailable(why))
            failed += 1
    return failed


def _set_timer(call: Call, delay_s: float) -> None:
    if call.timer is not None:
        call.timer.cancel()
    call.timer = call.fut.get_loop().call_later(max(0.0, delay_s), _expire, call)


def _expire(call: Call) -> None:
    forget(call)
    if call.fut.done():
        return
    call.settled = clock.monotonic()
    endpoint, before_deadline = call.peer.endpoint, clock.monotonic() < call.req.deadline
    if call.held and before_deadline:
        call.fut.set_exception(PeerUnavailable(f"{endpoint}: {call.held}; no new connection in time"))
    elif call.attempt_s is not None and before_deadline:
        call.fut.set_exception(DeadlineExceeded(
            f"no reply from {endpoint} within the attempt's {call.attempt_s * 1000:.0f} ms"))
    else:
        call.fut.set_exception(DeadlineExceeded(f"no reply from {endpoint} before the deadline"))
