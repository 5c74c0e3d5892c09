"""Reading a message off a ZeroMQ socket within the bounds of any message of the wire protocol.

libzmq's ``MAXMSGSIZE`` bounds each frame, not the frames of a multipart message: a peer's message of two million
empty frames (4 MB on the wire) became two million ``zmq.Frame`` objects in the receiving process, 729 MB of memory
and seconds of the event loop (measured here), before any decoder could refuse it. :class:`BoundedReceiver` is the
socket as :class:`mesh.zmq.pump.Pump` reads it: past ``MAX_FRAMES`` frames (plus a ROUTER's identity frame) or
``message_bytes_limit`` bytes it stops keeping frames, drains the rest of that message without making an object of
each (``recv_into`` a one-byte scratch buffer), and ends what it kept with :data:`CUT`, which the decoders
(:mod:`mesh.zmq.protocol`) and the server refuse as garbage.

What it cannot bound: libzmq holds a whole message before the receiver sees any part of it, so a peer that sends
one message without end grows libzmq's queue (bounded per frame by ``MAXMSGSIZE`` only). Only an admitted site
(CURVE) can send a message at all; a server that sees one cut logs it against that site.
"""

from __future__ import annotations

from typing import Any, Final

import zmq

from mesh.zmq.protocol_check import MAX_FRAMES, message_bytes_limit

__all__ = ["CUT", "BoundedReceiver"]

# The last frame of a message a BoundedReceiver cut short. Shared and never sent: only its identity matters.
CUT: Final = zmq.Frame(b"")


class BoundedReceiver(zmq.Socket):  # type: ignore[type-arg]
    """A socket's receive side with the message bounds (see the module): ``recv`` as pyzmq's, except that a message
    past ``frames`` frames or ``max_bytes`` bytes (its later frames drained unkept) ends early in :data:`CUT`.
    Made with :meth:`over`, a shadow of a socket (what ``mesh.zmq.pump.Pump`` reads with ``recv(copy=False)``)."""

    _seen: list[int]  # frames and bytes of the message being read (a list: pyzmq's setattr is slow)
    _frames: int
    _bytes: int

    @classmethod
    def over(cls, sock: zmq.Socket[Any], max_bytes: int, *, routed: bool) -> BoundedReceiver:
        """``sock``'s receiver for messages of at most ``max_bytes`` of tensors; ``routed``: a ROUTER's (one
        identity frame before the message)."""
        io = cls.shadow(sock.underlying)
        io.copy_threshold = sock.copy_threshold
        io._seen = [0, 0]
        io._frames = MAX_FRAMES + (1 if routed else 0)
        io._bytes = message_bytes_limit(max_bytes)
        return io

    def recv(self, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        # per frame on every hop: the base method and Frame are module constants (no super(), no global lookups)
        frame = _RECV(self, flags, copy, track)
        seen = self._seen
        if not (frame.more if type(frame) is _FRAME else self.get(zmq.RCVMORE)):
            seen[0] = seen[1] = 0
            return frame
        seen[0] += 1
        seen[1] += len(frame)
        if seen[0] < self._frames and seen[1] <= self._bytes:
            return frame
        seen[0] = seen[1] = 0
        scratch = bytearray(1)
        while self.get(zmq.RCVMORE):  # the rest of this message is here already: drained, truncated to a byte
            self.recv_into(scratch, flags=flags)
        return CUT


_RECV = zmq.Socket.recv
_FRAME = zmq.Frame
