"""A ZeroMQ message is bounded as a whole, not just frame by frame (``MAXMSGSIZE``): a peer's message of a hundred
thousand empty frames, or of a few frames each under the frame bound but over the message's, reaches the server's
dispatcher cut short (at most ``MAX_FRAMES`` frames and the message's byte bound, ending in ``CUT``), is refused as
garbage (answered, since its header names a request), and the server serves the next good request. Before, the
whole message reached the dispatcher, a ``zmq.Frame`` per frame (two million empty frames: 729 MB). Real ZeroMQ on
loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from mesh.errors import PayloadTooLarge, ProtocolError
from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq import protocol as p
from mesh.zmq.bounded import CUT
from mesh.zmq.protocol_check import MAX_FRAMES, check_envelope, message_bytes_limit
from mesh.zmq.server import ZmqServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
MAX_BYTES = 4096


async def echo(req: InferRequest) -> InferResponse:
    return InferResponse(request_id=req.request_id, outputs=dict(req.inputs), site="core", variant="echo",
                         accuracy=1.0, reason="local_ok", tenant=req.tenant, hops=[*req.hops, "core"])


def _request(rid: str) -> list[Any]:
    req = InferRequest(task="echo", inputs={"x": np.ones(4, np.float32)}, slo=SLO(1000.0), tenant="acme",
                       deadline=time.monotonic() + 5, hops=["edge-a"], request_id=rid)
    return p.encode_request(req)


@pytest.fixture
async def server() -> AsyncIterator[tuple[ZmqServer, list[list[Any]]]]:
    seen: list[list[Any]] = []
    srv = ZmqServer(echo, max_bytes=MAX_BYTES)
    async with srv:
        dispatch = srv._dispatch

        def record(msg: list[Any]) -> None:  # what the socket handed the dispatcher
            seen.append(msg)
            dispatch(msg)

        assert srv._pump is not None
        srv._pump.on_message = record  # the pump calls the dispatcher: see what it is handed
        yield srv, seen


async def _exchange(endpoint: str, frames: list[Any]) -> list[bytes]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send_multipart(frames, copy=True)
        async with asyncio.timeout(10):
            return list(await sock.recv_multipart())
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.parametrize("shape", ["many_frames", "many_bytes"])
async def test_a_message_over_its_bounds_is_cut_refused_and_answered(server: Any, shape: str) -> None:
    srv, seen = server
    header = _request("big")[0]
    if shape == "many_frames":  # each frame empty, within every frame bound; the message far over MAX_FRAMES
        frames = [header, *([b""] * 100_000)]
    else:  # three frames under the frame bound (MAXMSGSIZE), together over the message's byte bound
        chunk = b"x" * (message_bytes_limit(MAX_BYTES) // 2 + 1)
        frames = [header, chunk, chunk, chunk]
    reply = await _exchange(srv.endpoint, frames)
    rid, err = p.decode_reply(reply)
    assert rid == "big" and isinstance(err, PayloadTooLarge), err
    got = seen[-1]
    assert got[-1] is CUT  # the rest of the message was drained, not kept
    assert len(got) <= MAX_FRAMES + 2 and sum(len(f) for f in got) <= message_bytes_limit(MAX_BYTES) + len(header)
    assert srv.garbage.total == 1
    good = await _exchange(srv.endpoint, _request("good"))
    assert p.decode_response(good).request_id == "good"  # the next message is read whole and served
    assert seen[-1][-1] is not CUT


def test_the_decoders_check_the_envelope_first() -> None:
    frames = _request("r")
    assert check_envelope(frames, MAX_BYTES) is None
    with pytest.raises(ProtocolError, match="frames: at most"):
        p.decode_request([frames[0], *([b""] * MAX_FRAMES)], max_bytes=MAX_BYTES)
    with pytest.raises(PayloadTooLarge):
        p.decode_request([frames[0], b"x" * (message_bytes_limit(MAX_BYTES) + 1)], max_bytes=MAX_BYTES)
    with pytest.raises(PayloadTooLarge, match="cut short"):
        p.decode_reply([msgpack.packb({"v": 2, "kind": "rep", "id": "r"}), CUT], max_bytes=MAX_BYTES)
