"""The low-level socket pump under :mod:`mesh.zmq`: one ZeroMQ socket driven straight from
the asyncio event loop, without ``zmq.asyncio``.

``zmq.asyncio``'s per-operation Futures and flag enums cost more than the codec on a small
message. :class:`Pump` watches the socket's ``ZMQ_FD`` with ``loop.add_reader``, drains every
ready message in one callback, and sends with ``NOBLOCK`` (waiting for ``POLLOUT`` only when a
DEALER's queue is full). Sockets still come from the caller's context, so ``ctx.destroy()`` and
leak checks see them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from mesh.log import get_logger

__all__ = ["Pump", "io_socket"]

log = get_logger("mesh.zmq")

# plain ints: pyzmq's flag enums cost a Python call per bitwise operation
_EVENTS, _POLLIN, _POLLOUT, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_DRAIN_BATCH = 64  # messages per wake-up before other callbacks get a turn
# Below this a frame is copied into libzmq rather than lent to it: lending costs a pyzmq
# garbage-collector round trip per frame (~13 µs here), a memcpy of 100 KB ~7 µs; they cross near
# 256 KB (pyzmq's default threshold is 64 KB). Encoding itself never copies.
_COPY_THRESHOLD = 256 * 1024


class Pump:
    """Drives one socket from the event loop: ``on_message`` for every message received.

    ``ZMQ_FD`` is edge-triggered: any operation on the socket (a send included) may consume the
    wake-up of a message that arrived meanwhile, so every send is followed by ``after_send``,
    which looks at ``ZMQ_EVENTS`` and schedules a drain if input is waiting."""

    __slots__ = ("_soon", "_writable", "fd", "loop", "name", "on_message", "open", "sock")

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[zmq.Frame]], None], name: str) -> None:
        self.loop = asyncio.get_running_loop()
        self.sock = sock
        self.on_message = on_message
        self.name = name
        self.fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self.open = True
        self._soon = False
        self._writable: list[asyncio.Future[None]] = []
        self.loop.add_reader(self.fd, self._drain)

    def _drain(self) -> None:
        self._soon = False
        sock = self.sock
        for _ in range(_DRAIN_BATCH):
            if not self.open:
                return
            try:
                events: int = sock.getsockopt(_EVENTS)  # type: ignore[assignment]
                if events & _POLLOUT and self._writable:
                    self._wake_writers()
                if not events & _POLLIN:
                    return
                # not recv_multipart: it asks libzmq for RCVMORE once per frame through an enum
                # lookup, while every received Frame already says whether more parts follow (and
                # once a message's first part is here, all of it is)
                frame = sock.recv(_NOBLOCK, copy=False)
                msg = [frame]
                while frame.more:
                    frame = sock.recv(_NOBLOCK, copy=False)
                    msg.append(frame)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                log.warning("%s: receive failed: %s", self.name, exc)
                return
            try:
                self.on_message(msg)
            except Exception:  # the pump must outlive any single bad message
                log.exception("%s: failed to handle a message", self.name)
        self.kick()

    def kick(self) -> None:
        if not self._soon and self.open:
            self._soon = True
            self.loop.call_soon(self._drain)

    def after_send(self) -> None:
        if self._soon or not self.open:
            return
        try:
            events: int = self.sock.getsockopt(_EVENTS)  # type: ignore[assignment]
        except zmq.ZMQError:
            return
        if events & _POLLIN or (events & _POLLOUT and self._writable):
            self.kick()

    def send(self, frames: list[Any]) -> None:
        """Send now or raise ``zmq.Again`` (queue full) / ``zmq.ZMQError``. ``frames`` are
        ``bytes``, ``memoryview`` or ``zmq.Frame`` (what :mod:`mesh.zmq.protocol` writes)."""
        # the loop send_multipart runs, without its enum ``SNDMORE | flags`` per frame (which costs
        # more than the send). libzmq checks the high-water mark at a message's first part only, so
        # ``Again`` comes before anything of the message is queued.
        send = self.sock.send
        last = len(frames) - 1
        for i in range(last):
            send(frames[i], _MORE_NOBLOCK, copy=False)
        send(frames[last], _NOBLOCK, copy=False)
        self.after_send()

    async def wait_writable(self, within_s: float) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        self._writable.append(fut)
        self.kick()  # POLLOUT may already be set; the drain looks
        try:
            async with asyncio.timeout(within_s):
                await fut
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(ValueError):
                self._writable.remove(fut)

    def _wake_writers(self) -> None:
        waiters, self._writable = self._writable, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def close(self) -> None:
        """Stop watching; the caller closes the socket afterwards (never the other way round)."""
        if self.open:
            self.open = False
            self.loop.remove_reader(self.fd)
            self._wake_writers()


def io_socket(sock: zmq.Socket[Any]) -> zmq.Socket[Any]:
    """The socket to hand to :class:`Pump`: sends of large frames lend them, small ones copy."""
    # a plain (blocking-API) handle on the same libzmq socket; the asyncio wrapper stays idle
    io = zmq.Socket.shadow(sock.underlying) if isinstance(sock, zmq.asyncio.Socket) else sock
    io.copy_threshold = _COPY_THRESHOLD
    return io
