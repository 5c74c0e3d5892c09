"""A reply is bounded as a whole, as a request is (``test_zmq_message_bounds``): a hostile peer that answers one
request with a hundred thousand empty frames, or with a few frames each under the frame bound but over the message's,
has that reply cut short by the client (at most ``MAX_FRAMES`` frames and the message's byte bound, ending in ``CUT``,
its other frames drained unkept), and that request fails at once with a ``ProtocolError``, not at its deadline; the
peer's other request, answered properly, succeeds, and the client keeps working. Before, the client read the whole
reply into a ``zmq.Frame`` per frame (two million empty frames: 729 MB). Real ZeroMQ on loopback, the peer a bare
ROUTER."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from mesh.errors import ProtocolError
from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq import protocol as p
from mesh.zmq.bounded import CUT
from mesh.zmq.client import ZmqClient
from mesh.zmq.protocol_check import MAX_FRAMES, message_bytes_limit

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
MAX_BYTES = 4096
DEADLINE_S = 30.0  # far beyond the test's waits: a request that fails fails for its reply, not its deadline


def _request(tag: str) -> InferRequest:
    return InferRequest(task="echo", inputs={"x": np.ones(4, np.float32)}, slo=SLO(1000.0), tenant="acme",
                        deadline=time.monotonic() + DEADLINE_S, hops=["edge-a"], request_id=tag)


def _hostile_reply(header: bytes, shape: str) -> list[bytes]:
    if shape == "many_frames":  # each frame empty, within every frame bound; the message far over MAX_FRAMES
        return [header, *([b""] * 100_000)]
    # three frames under the frame bound (MAXMSGSIZE), together over the message's byte bound
    chunk = b"x" * (message_bytes_limit(MAX_BYTES) // 2 + 1)
    return [header, chunk, chunk, chunk]


@pytest.fixture
async def hostile() -> AsyncIterator[tuple[str, zmq.asyncio.Socket]]:
    """A compromised peer: a bare ROUTER on loopback, answering however the test says."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind("tcp://127.0.0.1:0")
        yield sock.getsockopt_string(zmq.LAST_ENDPOINT), sock
    finally:
        sock.close(0)
        ctx.term()


async def _serve_hostile(sock: zmq.asyncio.Socket, shape: str, n: int) -> None:
    """Answer ``n`` requests: the one whose id starts with ``big`` with a reply over the bounds (its header names
    it), the others properly."""
    for _ in range(n):
        ident, *frames = await sock.recv_multipart()
        req = p.decode_request(frames, max_bytes=MAX_BYTES)
        resp = InferResponse(request_id=req.request_id, outputs=dict(req.inputs), site="core", variant="echo",
                             accuracy=1.0, reason="local_ok", tenant=req.tenant, hops=[*req.hops, "core"])
        reply = [bytes(f) for f in p.encode_response(resp)]
        if req.request_id.startswith("big"):
            reply = _hostile_reply(reply[0], shape)
        await sock.send_multipart([ident, *reply], copy=True)


@pytest.mark.parametrize("shape", ["many_frames", "many_bytes"])
async def test_a_reply_over_its_bounds_is_cut_and_fails_its_request_only(
        hostile: tuple[str, zmq.asyncio.Socket], shape: str) -> None:
    endpoint, sock = hostile
    client = ZmqClient(max_bytes=MAX_BYTES)
    seen: list[list[Any]] = []
    on_reply = client._on_reply

    def record(peer: Any, msg: list[Any]) -> None:  # what the socket handed the reply dispatcher
        seen.append(msg)
        on_reply(peer, msg)

    client._on_reply = record  # type: ignore[method-assign]
    try:
        peer_side = asyncio.create_task(_serve_hostile(sock, shape, 3))
        started = time.monotonic()
        big = asyncio.create_task(client.request(endpoint, _request("big-1")))
        good = asyncio.create_task(client.request(endpoint, _request("good-1")))
        with pytest.raises(ProtocolError, match=r"reply from .* refused: .*cut short"):
            await big
        assert time.monotonic() - started < 10.0  # failed for its reply, not left to its deadline
        assert (await good).request_id == "good-1"  # the peer's other request is untouched
        cuts = [m for m in seen if m[-1] is CUT]  # the rest of that reply was drained, not kept
        assert len(cuts) == 1, [len(m) for m in seen]
        cut = cuts[0]
        assert len(cut) <= MAX_FRAMES + 1 and sum(len(f) for f in cut) <= 2 * message_bytes_limit(MAX_BYTES)
        assert client.garbage.total == 1
        after = await client.request(endpoint, _request("good-2"))  # the client, and its socket, keep working
        assert after.request_id == "good-2" and after.outputs["x"].tolist() == [1.0] * 4
        assert seen[-1][-1] is not CUT
        await asyncio.wait_for(peer_side, 10)
    finally:
        await client.close()
