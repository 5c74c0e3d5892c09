"""ZmqServer / ZmqClient over real ZeroMQ on 127.0.0.1."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from mesh.errors import (
    DeadlineExceeded,
    MeshError,
    Overloaded,
    PayloadTooLarge,
    PeerUnavailable,
    ProtocolError,
    UnknownTask,
)
from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq import protocol as p
from mesh.zmq.client import ZmqClient
from mesh.zmq.server import Handler, ZmqServer
from mesh.zmq.sync import SyncZmqClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def make_req(x: np.ndarray | float, *, deadline_s: float = 5.0, **inputs: np.ndarray) -> InferRequest:
    arr = np.full(4, x, np.float32) if isinstance(x, float | int) else x
    return InferRequest(task="echo", inputs={"x": arr, **inputs}, slo=SLO(1000.0), tenant="acme",
                        deadline=time.monotonic() + deadline_s, hops=["edge-a"])


def echo_response(req: InferRequest) -> InferResponse:
    return InferResponse(request_id=req.request_id, outputs=dict(req.inputs), site="core", variant="echo",
                         accuracy=1.0, reason="local_ok", tenant=req.tenant, hops=[*req.hops, "core"])


async def echo(req: InferRequest) -> InferResponse:
    return echo_response(req)


def open_sockets(ctx: zmq.Context[Any]) -> list[zmq.Socket[Any]]:
    return [s for s in list(ctx._sockets) if not s.closed]  # type: ignore[attr-defined]


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    try:
        yield context
    finally:
        leaked = open_sockets(context)
        context.destroy(linger=0)
    assert not leaked, f"sockets left open: {leaked}"


ServerFactory = Callable[..., Awaitable[ZmqServer]]


@pytest.fixture
async def serve(ctx: zmq.asyncio.Context) -> AsyncIterator[ServerFactory]:
    servers: list[ZmqServer] = []

    async def start(handler: Handler = echo, **kw: Any) -> ZmqServer:
        server = ZmqServer(handler, ctx=ctx, **kw)
        await server.start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for s in servers:
            await s.stop()


@pytest.fixture
async def client(ctx: zmq.asyncio.Context) -> AsyncIterator[ZmqClient]:
    c = ZmqClient(ctx=ctx)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def raw(ctx: zmq.asyncio.Context) -> AsyncIterator[Callable[[str], zmq.asyncio.Socket]]:
    socks: list[zmq.asyncio.Socket] = []

    def connect(endpoint: str) -> zmq.asyncio.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        socks.append(s)
        return s

    try:
        yield connect
    finally:
        for s in socks:
            s.close(linger=0)


async def test_round_trip_two_tensors(serve: ServerFactory, client: ZmqClient) -> None:
    server = await serve()
    rng = np.random.default_rng(1)
    small = rng.standard_normal(256).astype(np.float32)            # 1 KB
    big = rng.standard_normal((512, 512)).astype(np.float32)       # 1 MB
    resp = await client.request(server.endpoint, make_req(small, big=big))
    np.testing.assert_array_equal(resp.outputs["x"], small)
    np.testing.assert_array_equal(resp.outputs["big"], big)
    assert resp.outputs["big"].shape == (512, 512)
    assert (resp.site, resp.variant, resp.tenant, resp.hops) == ("core", "echo", "acme", ["edge-a", "core"])


async def test_round_trip_text_tensor(serve: ServerFactory, client: ZmqClient) -> None:
    """A BYTES tensor (text) crosses real ZeroMQ both ways: a forwarded text query and an echoed reply."""
    server = await serve()
    text = np.array([b"Real-time strategy game", "caf\u00e9 \u2615".encode(), b"", b"\xff\x00"], dtype=object)
    resp = await client.request(server.endpoint, make_req(1.0, text=text))
    assert resp.outputs["text"].dtype == object and resp.outputs["text"].tolist() == text.tolist()


async def test_200_concurrent_requests_matched_by_id(serve: ServerFactory, client: ZmqClient) -> None:
    async def shuffled_echo(req: InferRequest) -> InferResponse:
        await asyncio.sleep(random.random() * 0.02)  # replies come back out of order
        return echo_response(req)

    server = await serve(shuffled_echo)
    values = [float(i) for i in range(200)]
    replies = await asyncio.gather(*(client.request(server.endpoint, make_req(v)) for v in values))
    for v, r in zip(values, replies, strict=True):
        np.testing.assert_array_equal(r.outputs["x"], np.full(4, v, np.float32))
    assert client.pending(server.endpoint) == 0


async def test_same_id_from_two_callers_and_overlong_ids(serve: ServerFactory, client: ZmqClient) -> None:
    async def slow_echo(req: InferRequest) -> InferResponse:
        await asyncio.sleep(0.05)
        return echo_response(req)

    server = await serve(slow_echo)
    reqs = [_with_id(make_req(float(i)), "dup") for i in range(3)] + [_with_id(make_req(9.0), "L" * 1000)]
    replies = await asyncio.gather(*(client.request(server.endpoint, r) for r in reqs))
    assert [r.outputs["x"][0] for r in replies] == [0.0, 1.0, 2.0, 9.0]
    assert [r.request_id for r in replies] == ["dup"] * 3 + ["L" * 1000]


async def test_slow_handler_gives_deadline_exceeded(serve: ServerFactory, client: ZmqClient) -> None:
    calls = 0

    async def slow(req: InferRequest) -> InferResponse:
        nonlocal calls
        calls += 1
        await asyncio.sleep(3.0)
        return echo_response(req)

    server = await serve(slow)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await client.request(server.endpoint, make_req(1.0, deadline_s=0.5))
    elapsed = time.monotonic() - t0
    assert 0.4 <= elapsed < 2.5 and calls == 1
    await asyncio.sleep(0.2)
    assert server.inflight == 0  # the server gave up on the handler at the deadline too


async def test_late_reply_is_dropped(serve: ServerFactory, client: ZmqClient) -> None:
    returned = asyncio.Event()

    async def late(req: InferRequest) -> InferResponse:
        if req.inputs["x"][0] < 0:
            await asyncio.sleep(1.0)
            returned.set()
        return echo_response(req)

    server = await serve(late, enforce_deadline=False)
    with pytest.raises(DeadlineExceeded):
        await client.request(server.endpoint, make_req(-1.0, deadline_s=0.3))
    await asyncio.wait_for(returned.wait(), 5)
    for _ in range(100):
        if client.late_replies:
            break
        await asyncio.sleep(0.05)
    assert client.late_replies == 1
    resp = await client.request(server.endpoint, make_req(7.0))
    assert resp.outputs["x"][0] == 7.0


async def test_expired_request_answered_without_handler(serve: ServerFactory, client: ZmqClient,
                                                        raw: Callable[[str], zmq.asyncio.Socket]) -> None:
    calls = 0

    async def counting(req: InferRequest) -> InferResponse:
        nonlocal calls
        calls += 1
        return echo_response(req)

    server = await serve(counting)
    req = make_req(1.0, deadline_s=-1.0)
    req.request_id = "expired-1"
    sock = raw(server.endpoint)
    await sock.send_multipart(p.encode_request(req))
    frames = await asyncio.wait_for(sock.recv_multipart(), 5)
    with pytest.raises(DeadlineExceeded):
        p.decode_response(frames)
    with pytest.raises(DeadlineExceeded):  # the client refuses to send it at all
        await client.request(server.endpoint, make_req(1.0, deadline_s=-1.0))
    assert calls == 0


async def _blocked_requests(server: ZmqServer, client: ZmqClient, n: int) -> list[asyncio.Task[Any]]:
    tasks = [asyncio.create_task(client.request(server.endpoint, make_req(-1.0, deadline_s=30.0)))
             for _ in range(n)]
    for _ in range(200):
        if server.inflight == n:
            return tasks
        await asyncio.sleep(0.02)
    raise AssertionError(f"only {server.inflight} of {n} requests reached the handler")


async def blocking(req: InferRequest) -> InferResponse:
    if req.inputs["x"][0] < 0:
        await asyncio.sleep(3600)
    return echo_response(req)


async def test_server_stop_fails_pending_promptly(serve: ServerFactory, client: ZmqClient) -> None:
    server = await serve(blocking)
    tasks = await _blocked_requests(server, client, 5)
    t0 = time.monotonic()
    await server.stop()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    assert time.monotonic() - t0 < 5.0  # the deadline is 30 s away: the disconnect event did it
    assert all(isinstance(r, PeerUnavailable) for r in results), results


async def test_fail_peer_fails_pending_and_reconnects(serve: ServerFactory, client: ZmqClient) -> None:
    server = await serve(blocking)
    tasks = await _blocked_requests(server, client, 4)
    assert client.fail_peer(server.endpoint, "lease expired") == 4
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert all(isinstance(r, PeerUnavailable) and "lease expired" in str(r) for r in results), results
    assert client.fail_peer(server.endpoint, "again") == 0
    resp = await client.request(server.endpoint, make_req(3.0))  # a fresh socket to the same peer
    assert resp.outputs["x"][0] == 3.0


async def test_handler_errors_become_error_replies(serve: ServerFactory, client: ZmqClient) -> None:
    async def failing(req: InferRequest) -> InferResponse:
        if req.inputs["x"][0] == 1.0:
            raise UnknownTask("no task 'echo' here")
        raise ValueError("bug in handler")

    server = await serve(failing)
    with pytest.raises(UnknownTask, match="no task"):
        await client.request(server.endpoint, make_req(1.0))
    with pytest.raises(MeshError) as info:
        await client.request(server.endpoint, make_req(2.0))
    assert type(info.value) is MeshError and info.value.code == "internal"
    assert "ValueError" in info.value.message


async def test_overloaded_beyond_max_inflight(serve: ServerFactory, client: ZmqClient) -> None:
    server = await serve(blocking, max_inflight=2)
    tasks = await _blocked_requests(server, client, 2)
    with pytest.raises(Overloaded):
        await client.request(server.endpoint, make_req(1.0))
    client.fail_peer(server.endpoint, "test over")
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_hostile_frames_do_not_stop_the_server(serve: ServerFactory, client: ZmqClient,
                                                     raw: Callable[[str], zmq.asyncio.Socket]) -> None:
    server = await serve(max_bytes=4096)
    sock = raw(server.endpoint)
    good = p.encode_request(_with_id(make_req(1.0), "hostile-1"))
    header = msgpack.unpackb(good[0])
    flipped = bytearray(bytes(good[0]))
    flipped[len(flipped) // 2] ^= 0xFF
    no_id = [[b""], [b"\xc1\xc1"], [b"\x00" * 64], [bytes(flipped)], [msgpack.packb({"v": 1, "kind": "req"})],
             [msgpack.packb({**header, "v": 99, "id": 5})], [msgpack.packb([1, 2])]]
    for frames in no_id:
        await sock.send_multipart(frames)
    too_big = {**header, "id": "big", "tensors": [{"name": n, "dtype": "uint8", "shape": [3000]} for n in "ab"]}
    with_id: list[tuple[list[bytes], str]] = [
        ([bytes(good[0])], "protocol"),                                       # tensor frame missing
        ([bytes(good[0]), b"\x00" * 3], "protocol"),                          # wrong byte length
        ([msgpack.packb({**header, "slo": "fast"}), bytes(good[1])], "protocol"),
        ([msgpack.packb(too_big), b"\x00" * 3000, b"\x00" * 3000], "too_large"),
    ]
    for frames, _ in with_id:
        await sock.send_multipart(frames)
    for _, code in with_id:  # replies in order; none came for the messages without a readable id
        rid, err = p.decode_reply(await asyncio.wait_for(sock.recv_multipart(), 5))
        assert isinstance(err, MeshError) and err.code == code and rid in ("hostile-1", "big")
    assert isinstance(err, PayloadTooLarge)
    assert isinstance(p.decode_reply(p.encode_error("x", ProtocolError("y")))[1], ProtocolError)
    resp = await client.request(server.endpoint, make_req(5.0))
    assert resp.outputs["x"][0] == 5.0


def _with_id(req: InferRequest, rid: str) -> InferRequest:
    req.request_id = rid
    return req


async def test_client_refuses_oversized_request(serve: ServerFactory, ctx: zmq.asyncio.Context) -> None:
    server = await serve()
    async with ZmqClient(ctx=ctx, max_bytes=1024) as small:
        with pytest.raises(PayloadTooLarge):
            await small.request(server.endpoint, make_req(np.zeros(1024, np.float32)))


async def test_sync_client(serve: ServerFactory) -> None:
    server = await serve()

    def call() -> InferResponse:
        with SyncZmqClient(server.endpoint) as c:
            return c.request(make_req(9.0))

    resp = await asyncio.to_thread(call)
    assert resp.outputs["x"][0] == 9.0 and resp.site == "core"


async def test_bad_endpoint_is_peer_unavailable(client: ZmqClient) -> None:
    with pytest.raises(PeerUnavailable, match="cannot connect"):
        await client.request("tcp://no-such-host-name:", make_req(1.0))
    with pytest.raises(DeadlineExceeded):  # nobody listens: only the deadline ends the wait
        await client.request("tcp://127.0.0.1:9", make_req(1.0, deadline_s=0.3))


async def test_no_leaks_after_close(ctx: zmq.asyncio.Context) -> None:
    before = asyncio.all_tasks()
    server = ZmqServer(blocking, ctx=ctx)
    await server.start()
    client = ZmqClient(ctx=ctx)
    await client.request(server.endpoint, make_req(1.0))
    pending = asyncio.create_task(client.request(server.endpoint, make_req(-1.0, deadline_s=30.0)))
    await asyncio.sleep(0.1)
    assert len(open_sockets(ctx)) == 3  # ROUTER, DEALER and its monitor
    await client.close()
    with pytest.raises(PeerUnavailable):
        await pending
    await server.stop()
    assert open_sockets(ctx) == []
    assert asyncio.all_tasks() == before


async def test_a_decoder_bug_on_hostile_input_is_answered_as_garbage_not_logged_per_message(
        serve: ServerFactory, client: ZmqClient, raw: Callable[[str], zmq.asyncio.Socket],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever a decoder raises on a peer's bytes is that peer's garbage: an error reply where an id can be
    read, counted and logged at the garbage rate (once per peer every 10 s), not an error log per message."""
    server = await serve()
    real = p.decode_request

    def broken(frames: Any, **kw: Any) -> InferRequest:
        if bytes(frames[0]).find(b"poison") >= 0:
            raise ValueError("a decoder bug")
        return real(frames, **kw)

    monkeypatch.setattr(p, "decode_request", broken)
    sock = raw(server.endpoint)
    for i in range(20):
        await sock.send_multipart(p.encode_request(_with_id(make_req(1.0), f"poison-{i}")))
    for _ in range(20):
        _, err = p.decode_reply(await asyncio.wait_for(sock.recv_multipart(), 5))
        assert isinstance(err, ProtocolError) and "a decoder bug" in err.message
    assert server.garbage.total == 20 and server.garbage.logged == 1
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    resp = await client.request(server.endpoint, make_req(5.0))
    assert resp.outputs["x"][0] == 5.0


def test_the_sync_client_cuts_a_reply_of_endless_frames() -> None:
    """A peer answering with a million empty frames (the async client's bound, ``mesh.zmq.bounded``): the blocking
    client keeps at most MAX_FRAMES of them and refuses the reply as garbage, not a million Frame objects."""
    import threading

    import zmq

    from mesh.zmq.protocol_check import DECODE_ERRORS, MAX_FRAMES

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        if router.poll(10_000):
            ident = router.recv_multipart()[0]
            router.send_multipart([ident, *([b""] * 1_000_000)])

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with SyncZmqClient(f"tcp://127.0.0.1:{port}", ctx=ctx) as c:
            with pytest.raises(DECODE_ERRORS, match="cut short"):
                c.request(make_req(1.0, deadline_s=20.0))
            assert MAX_FRAMES < 1_000_000
    finally:
        t.join(timeout=15)
        router.close(linger=0)
        ctx.term()
