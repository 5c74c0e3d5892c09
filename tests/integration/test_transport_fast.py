"""The transport's hot-path choices, over real ZeroMQ on 127.0.0.1: ends created without a context
share one (one I/O thread) and release it; ends with security keep their own; the socket pump's own
multipart send and receive keep messages whole."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq.base import SharedContext
from mesh.zmq.client import ZmqClient
from mesh.zmq.pump import Pump, io_socket
from mesh.zmq.server import ZmqServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def make_req(**inputs: np.ndarray) -> InferRequest:
    return InferRequest(task="echo", inputs=inputs, slo=SLO(1000.0), tenant="acme", deadline=time.monotonic() + 5.0)


async def echo(req: InferRequest) -> InferResponse:
    return InferResponse(request_id=req.request_id, outputs=dict(req.inputs), site="core", variant="echo",
                         accuracy=1.0, reason="local_ok", tenant=req.tenant)


class CurveKeys:
    """Real CURVE on both ends (no ZAP handler, so libzmq admits any client key)."""

    def __init__(self) -> None:
        self.server_public, self.server_secret = zmq.curve_keypair()
        self.client_public, self.client_secret = zmq.curve_keypair()

    def apply_server(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_server = True
        sock.curve_secretkey = self.server_secret

    def apply_client(self, sock: zmq.Socket[Any], server_key: bytes | None) -> None:
        sock.curve_serverkey = server_key or self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret

    def release_server(self, sock: zmq.Socket[Any]) -> None:
        pass

    def peer(self, frame: zmq.Frame) -> str | None:
        return "any"  # no ZAP handler: every client key is admitted, under one name


async def test_ends_without_a_context_share_one_and_release_it() -> None:
    users = SharedContext.users()
    server = ZmqServer(echo)
    client = ZmqClient()
    try:
        await server.start()
        resp = await client.request(server.endpoint, make_req(x=np.arange(8, dtype=np.float32)))
        np.testing.assert_array_equal(resp.outputs["x"], np.arange(8, dtype=np.float32))
        shared = server._ctx  # private: which context each end runs on is not public API
        assert shared is not None and client._ctx is shared
        assert SharedContext.users() == users + 2
    finally:
        await client.close()
        await server.stop()
    assert SharedContext.users() == users
    if users == 0:
        assert shared.closed  # the last end out destroyed it: no I/O thread left behind


async def test_an_unused_client_holds_no_context() -> None:
    users = SharedContext.users()
    client = ZmqClient()
    assert SharedContext.users() == users
    await client.close()
    assert SharedContext.users() == users


async def test_failed_start_releases_the_shared_context() -> None:
    users = SharedContext.users()
    async with ZmqServer(echo) as first:
        taken = first.endpoint
        second = ZmqServer(echo, bind=taken)
        with pytest.raises(zmq.ZMQError):
            await second.start()
        assert SharedContext.users() == users + 1
        await second.stop()
    assert SharedContext.users() == users


async def test_secured_ends_share_a_context_only_with_the_same_security() -> None:
    keys, other = CurveKeys(), CurveKeys()
    users = SharedContext.users()
    server = ZmqServer(echo, security=keys)
    client = ZmqClient(security=keys)
    stranger = ZmqServer(echo, security=other)
    try:
        await server.start()
        await stranger.start()
        resp = await client.request(server.endpoint, make_req(x=np.ones(4, np.float32)))
        np.testing.assert_array_equal(resp.outputs["x"], np.ones(4, np.float32))
        own = (server._ctx, client._ctx, stranger._ctx)  # private: see above
        assert own[0] is not None and own[0] is own[1] and own[2] is not None and own[2] is not own[0]
        assert SharedContext.users() == users  # a ZAP handler is per context: never the shared one
        await server.stop()
        assert not own[0].closed  # the client still holds it
    finally:
        await client.close()
        await server.stop()
        await stranger.stop()
    assert own[0].closed and own[2].closed


async def test_a_given_context_is_left_open() -> None:
    ctx = zmq.asyncio.Context()
    try:
        async with ZmqServer(echo, ctx=ctx) as server, ZmqClient(ctx=ctx) as client:
            await client.request(server.endpoint, make_req(x=np.ones(2, np.float32)))
        assert not ctx.closed
        ctx.socket(zmq.DEALER).close(linger=0)  # still usable
    finally:
        ctx.destroy(linger=0)


async def test_many_tensor_frames_round_trip_whole() -> None:
    inputs = {f"t{i}": np.full(i + 1, i, np.int32) for i in range(40)}
    async with ZmqServer(echo) as server, ZmqClient() as client:
        replies = await asyncio.gather(*(client.request(server.endpoint, make_req(**inputs)) for _ in range(20)))
    for resp in replies:
        assert list(resp.outputs) == list(inputs)
        for name, arr in inputs.items():
            np.testing.assert_array_equal(resp.outputs[name], arr)


async def test_pump_send_is_all_or_nothing_when_the_queue_is_full() -> None:
    """``Again`` leaves no part of a message queued: what the peer later gets is whole messages,
    exactly those whose send returned."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 2)
    dealer.setsockopt(zmq.RECONNECT_IVL, 20)
    pump: Pump | None = None
    try:
        with socket.socket() as probe:  # a free port, with nobody listening on it yet
            probe.bind(("127.0.0.1", 0))
            endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        dealer.connect(endpoint)  # the dealer queues up to its high-water mark meanwhile
        pump = Pump(io_socket(dealer), lambda msg: None, "test dealer")
        sent: list[int] = []
        refused = 0
        for i in range(10):
            frames = [f"head {i}".encode(), memoryview(np.full(300, i, np.float32)).cast("B"), b"tail"]
            try:
                pump.send(frames)
                sent.append(i)
            except zmq.Again:
                refused += 1
        assert refused > 0 and sent, (sent, refused)
        router.bind(endpoint)
        got: list[int] = []
        deadline = time.monotonic() + 10.0
        while len(got) < len(sent) and time.monotonic() < deadline:
            if await router.poll(200):
                msg = await router.recv_multipart()
                assert len(msg) == 4 and msg[3] == b"tail", msg  # identity + the three frames
                i = int(msg[1].split()[1])
                np.testing.assert_array_equal(np.frombuffer(msg[2], np.float32), np.full(300, i, np.float32))
                got.append(i)
        assert got == sent
        assert await router.poll(100) == 0  # nothing half-sent trails behind
    finally:
        if pump is not None:
            pump.close()
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.destroy(linger=0)
