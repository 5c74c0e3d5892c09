"""A blocking site-to-site client, one request at a time: for benchmarks and tests of the wire
without asyncio's cost. Serving code uses :class:`mesh.zmq.client.ZmqClient`.

Replies are read within the bounds the async client keeps (``MAXMSGSIZE`` per frame, and
:class:`mesh.zmq.bounded.BoundedReceiver` per message: ``MAX_FRAMES`` frames, ``message_bytes_limit(max_bytes)``
bytes): a peer's reply of endless frames is cut and refused as garbage, never kept whole."""

from __future__ import annotations

from typing import Any, Self

import zmq

from mesh.errors import DeadlineExceeded, MeshError
from mesh.types import InferRequest, InferResponse, new_request_id
from mesh.zmq import protocol as wire
from mesh.zmq.base import SocketSecurity, dual_stack
from mesh.zmq.bounded import BoundedReceiver
from mesh.zmq.protocol_check import DEFAULT_MAX_BYTES, MAX_HEADER_BYTES

__all__ = ["SyncZmqClient"]


class SyncZmqClient:
    """Blocking client, one request at a time: for benchmarks of the wire without asyncio's cost."""

    def __init__(self, endpoint: str, *, ctx: zmq.Context[Any] | None = None,
                 security: SocketSecurity | None = None, server_key: bytes | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._own_ctx = ctx is None
        self._ctx: zmq.Context[Any] = dual_stack(zmq.Context()) if ctx is None else ctx
        self._sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + MAX_HEADER_BYTES)
        self._recv = BoundedReceiver.over(self._sock, max_bytes, routed=False)
        if security is not None:
            security.apply_client(self._sock, server_key)
        self._sock.connect(endpoint)
        self.endpoint = endpoint

    def request(self, req: InferRequest) -> InferResponse:
        if not req.request_id:
            req.request_id = new_request_id()
        self._sock.send_multipart(wire.encode_request(req), copy=False)
        while (left_ms := req.remaining_ms()) > 0:
            if not self._sock.poll(max(1, int(left_ms)), zmq.POLLIN):
                continue
            rid, out = wire.decode_reply(self._recv.recv_multipart(copy=False))
            if rid != req.request_id:
                continue  # a late reply to an earlier request
            if isinstance(out, MeshError):
                raise out
            return out
        raise DeadlineExceeded(f"no reply from {self.endpoint} before the deadline")

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
