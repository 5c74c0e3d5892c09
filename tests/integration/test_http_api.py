"""The V2 HTTP front over a real ONNX data plane, driven by raw HTTP and by the SDK (async and sync)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from edge_agent.http_api import EdgeHttpServer
from mesh import errors
from mesh.client import AsyncClient, Client
from mesh.sdk_transport import AiohttpTransport
from mesh.v2 import codec as codec
from mesh.v2.body import HEADER_LENGTH
from tests.helpers_dataplane import OnnxDataPlane, digits_model, serve_in_thread
from tests.helpers_models import digits_split

pytestmark = pytest.mark.integration

TASK = "digit-classification"
MAX_BODY = 256 << 10


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return digits_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    split = digits_split()
    return split.x_val, split.y_val


@pytest.fixture
def dp(model_path: Path) -> Iterator[OnnxDataPlane]:
    plane = OnnxDataPlane("edge-test", model_path, accuracy=0.96, tenants=frozenset({"public", "acme"}))
    try:
        yield plane
    finally:
        plane.close()


@pytest.fixture
async def server(dp: OnnxDataPlane) -> AsyncIterator[EdgeHttpServer]:
    async with EdgeHttpServer(dp, max_body_bytes=MAX_BODY) as srv:
        yield srv


@pytest.fixture
async def http(server: EdgeHttpServer) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(server.url) as session:
        yield session


def _json_infer(x: np.ndarray, **params: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}],
            "parameters": {"latency_ms": 1000, **params}}


async def _good_request(http: aiohttp.ClientSession, dp: OnnxDataPlane, x: np.ndarray) -> None:
    """The server still answers correctly: asserted after every rejection."""
    async with http.post(f"/v2/models/{TASK}/infer", json=_json_infer(x)) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    got = np.array(body["outputs"][0]["data"], np.float32).reshape(body["outputs"][0]["shape"])
    np.testing.assert_allclose(got, dp.run_direct({"x": x})["logits"], rtol=1e-5, atol=1e-6)


async def test_health_and_metadata(http: aiohttp.ClientSession, dp: OnnxDataPlane) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{TASK}/ready"):
        async with http.get(path) as resp:
            assert resp.status == 200, path
    async with http.get("/v2") as resp:
        meta = await resp.json()
    assert meta["name"] == "tiermesh"
    assert set(meta["extensions"]) >= {"binary_tensor_data", "tiermesh_slo", "classification", "statistics"}
    async with http.get(f"/v2/models/{TASK}") as resp:
        model = await resp.json()
    assert model["name"] == TASK and model["platform"] == "tiermesh"
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}]
    assert dp.variant not in json.dumps(model)  # callers never see variant names
    dp.is_ready = False
    for path in ("/v2/health/ready", f"/v2/models/{TASK}/ready"):
        async with http.get(path) as resp:
            assert resp.status == 503, path
    async with http.get("/v2/health/live") as resp:
        assert resp.status == 200
    for path in ("/v2/models/nope", "/v2/models/nope/ready"):
        async with http.get(path) as resp:
            assert resp.status == 404 and (await resp.json())["code"] == "unknown_task"


async def test_json_and_binary_infer_match_onnxruntime(http: aiohttp.ClientSession, dp: OnnxDataPlane,
                                                       digits: tuple[np.ndarray, np.ndarray]) -> None:
    x = digits[0][:16]
    want = dp.run_direct({"x": x})["logits"]
    async with http.post(f"/v2/models/{TASK}/infer", json={**_json_infer(x), "id": "req-7"},
                         headers={"X-Tiermesh-Tenant": "acme"}) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["id"] == "req-7" and body["model_name"] == TASK
    p = body["parameters"]
    assert (p["site"], p["variant"], p["tenant"], p["reason"], p["best_effort"], p["hops"]) == (
        "edge-test", dp.variant, "acme", "local_ok", False, "edge-test")
    assert p["accuracy"] == 0.96 and p["timing_ms_total"] >= p["timing_ms_compute"] > 0
    np.testing.assert_allclose(np.array(body["outputs"][0]["data"], np.float32).reshape(16, 10), want,
                               rtol=1e-5, atol=1e-6)

    req, hlen = codec.encode_infer_request({"x": x}, {"latency_ms": 500}, binary=True)
    async with http.post(f"/v2/models/{TASK}/infer", data=req,
                         headers={HEADER_LENGTH: str(hlen)}) as resp:
        assert resp.status == 200
        rlen = resp.headers[HEADER_LENGTH]
        dec = codec.decode_infer_response(await resp.read(), int(rlen))
    np.testing.assert_array_equal(dec.outputs["logits"], want)  # binary is bit-exact
    assert len(dec.request_id) >= 16 and dec.parameters["tenant"] == "public"  # generated id


def _tensor(name: str, shape: list[int], datatype: str, n: int) -> tuple[bytes, dict[str, str]]:
    t = {"name": name, "shape": shape, "datatype": datatype, "data": [0.0] * n}
    return json.dumps({"inputs": [t]}).encode(), {}


def _bin(x: np.ndarray, declared: int | None = None, cut: int = 0) -> tuple[bytes, dict[str, str]]:
    raw = x.astype(np.float32).tobytes()
    head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": declared or len(raw)}}]}).encode()
    return head + raw[:len(raw) - cut], {HEADER_LENGTH: str(len(head))}


X1 = np.linspace(0, 1, 128, dtype=np.float32).reshape(2, 64)
BAD: list[tuple[str, str, Callable[[], tuple[bytes, dict[str, str]]], int, str, str]] = [
    ("bad json", TASK, lambda: (b'{"inputs": [', {}), 400, "bad_request", "not valid JSON"),
    ("shape vs data", TASK, lambda: _tensor("x", [2, 64], "FP32", 127), 400, "bad_tensor", "needs 128"),
    ("unknown datatype", TASK, lambda: _tensor("x", [1, 64], "FP31", 64), 400, "bad_tensor",
     "unsupported datatype"),
    ("dtype not the task's", TASK, lambda: _tensor("x", [1, 64], "FP64", 64), 400, "bad_tensor",
     "expected dtype float32, got float64"),
    ("wrong width", TASK, lambda: _tensor("x", [1, 63], "FP32", 63), 400, "bad_tensor", "shape"),
    ("missing input", TASK, lambda: _tensor("y", [1, 64], "FP32", 64), 400, "bad_tensor",
     "missing input"),
    ("unknown task", "no-such-task", lambda: (json.dumps(_json_infer(X1)).encode(), {}),
     404, "unknown_task", "no-such-task"),
    ("negative latency", TASK, lambda: (json.dumps(_json_infer(X1, latency_ms=-5)).encode(), {}),
     400, "bad_request", "latency_ms must be positive"),
    ("accuracy > 1", TASK, lambda: (json.dumps(_json_infer(X1, min_accuracy=1.5)).encode(), {}),
     400, "bad_request", "min_accuracy"),
    ("bad prefer", TASK, lambda: (json.dumps(_json_infer(X1, prefer="cheap")).encode(), {}),
     400, "bad_request", "prefer"),
    ("tenant spoof", TASK, lambda: (json.dumps(_json_infer(X1, tenant="acme")).encode(), {}),
     403, "forbidden", "identity"),
    ("oversized body", TASK, lambda: (json.dumps(_json_infer(np.zeros((1200, 64), np.float32))).encode(), {}),
     413, "too_large", "limit"),
    ("declared binary too large", TASK, lambda: _bin(X1, declared=MAX_BODY * 4), 413, "too_large", "exceeds"),
    ("truncated binary", TASK, lambda: _bin(X1, cut=8), 400, "bad_tensor", "truncated"),
    ("bad header length", TASK, lambda: (b"{}", {HEADER_LENGTH: "ten"}), 400, "bad_request", "integer"),
    # a digit int() refuses (superscript two): still the caller's 400, never a 500
    ("digit header length", TASK, lambda: (b"{}", {HEADER_LENGTH: "\u00b2"}), 400, "bad_request", "integer"),
    ("unknown output", TASK,
     lambda: (json.dumps({**_json_infer(X1), "outputs": [{"name": "probs"}]}).encode(), {}),
     400, "bad_tensor", "no output"),
    ("refuse impossible", TASK, lambda: (json.dumps(_json_infer(X1, min_accuracy=0.999, prefer="refuse")
                                                    ).encode(), {}), 422, "impossible_slo", "0.999"),
    ("unknown tenant", TASK, lambda: (json.dumps(_json_infer(X1)).encode(), {"X-Tiermesh-Tenant": "mallory"}),
     403, "unknown_tenant", "mallory"),
]


@pytest.mark.parametrize("task, make, status, code, fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
async def test_malformed_request_gets_4xx_and_server_keeps_serving(
        http: aiohttp.ClientSession, dp: OnnxDataPlane, task: str,
        make: Callable[[], tuple[bytes, dict[str, str]]], status: int, code: str, fragment: str) -> None:
    body, headers = make()
    async with http.post(f"/v2/models/{task}/infer", data=body,
                         headers={"Content-Type": "application/json", **headers}) as resp:
        err = await resp.json()
        assert resp.status == status, err
    assert err["code"] == code and fragment in err["error"], err
    await _good_request(http, dp, X1)


async def test_oversized_chunked_body_is_413(http: aiohttp.ClientSession, dp: OnnxDataPlane) -> None:
    """No Content-Length to check up front: the limit must hold while reading the stream."""
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(MAX_BODY // 4096 + 8):
            yield b" " * 4096

    async with http.post(f"/v2/models/{TASK}/infer", data=chunks()) as resp:
        assert resp.status == 413
        assert (await resp.json())["code"] == "too_large"
    await _good_request(http, dp, X1)


async def test_unrouted_path_is_a_json_404(http: aiohttp.ClientSession, dp: OnnxDataPlane) -> None:
    async with http.get("/v2/nothing/here") as resp:
        assert resp.status == 404 and "error" in await resp.json()
    await _good_request(http, dp, X1)


async def test_async_sdk_against_real_server(server: EdgeHttpServer, dp: OnnxDataPlane,
                                             digits: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits
    for binary in (True, False):
        async with AsyncClient(server.url, tenant="acme", binary=binary) as client:
            sig = await client.task_metadata(TASK)
            assert sig == dp.signature and await client.ready()
            r = await client.infer(TASK, x, latency_ms=2000, min_accuracy=0.9, request_id=f"b{binary}")
            assert (r.site, r.variant, r.tenant, r.request_id, r.best_effort) == (
                "edge-test", dp.variant, "acme", f"b{binary}", False)
            np.testing.assert_allclose(r.output(), dp.run_direct({"x": x})["logits"], rtol=1e-5, atol=1e-6)
            assert float(np.mean(r.output().argmax(axis=1) == y)) > 0.9
            best = await client.infer(TASK, {"x": x[:3]}, latency_ms=2000, min_accuracy=0.99)
            assert best.best_effort and best.reason == "best_effort_accuracy"
            with pytest.raises(errors.ImpossibleSLO):
                await client.infer(TASK, x[:3], latency_ms=2000, min_accuracy=0.99, prefer="refuse")
            with pytest.raises(errors.BadTensor):
                await client.infer(TASK, x[:3].astype(np.float64), latency_ms=2000)
            with pytest.raises(errors.UnknownTask):
                await client.infer("nope", x[:3], latency_ms=2000)


async def test_async_sdk_reuses_one_connection_and_leaks_nothing(dp: OnnxDataPlane) -> None:
    peers: list[Any] = []

    @web.middleware
    async def record(request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        return await handler(request)

    srv = EdgeHttpServer(dp)
    srv.app.middlewares.append(record)  # before start(): the app freezes then
    before = asyncio.all_tasks()
    async with srv:
        client = AsyncClient(srv.url)
        for _ in range(20):
            r = await client.infer(TASK, X1, latency_ms=2000)
            assert r.output().shape == (2, 10)
        transport = client.transport
        assert isinstance(transport, AiohttpTransport)
        session = transport.session
        await client.aclose()
    assert len(peers) == 21  # 20 infers + the one metadata fetch for the bare array's input name
    assert len(set(peers)) == 1, set(peers)
    assert session is not None and session.closed and transport.session is None
    await asyncio.sleep(0)
    assert asyncio.all_tasks() <= before


async def test_unreachable_agent_is_peer_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with AsyncClient(f"http://127.0.0.1:{port}", timeout=5) as client:
        with pytest.raises(errors.PeerUnavailable):
            await client.ready()


def test_sync_sdk_against_real_server(dp: OnnxDataPlane, digits: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits
    before = set(threading.enumerate())
    with serve_in_thread(dp) as srv, Client(srv.url, tenant="acme") as client:
        assert client.ready()
        results = [client.infer(TASK, x, latency_ms=2000) for _ in range(5)]
        for r in results:
            np.testing.assert_allclose(r.output(), dp.run_direct({"x": x})["logits"], rtol=1e-5, atol=1e-6)
            assert r.tenant == "acme" and r.site == "edge-test"
        assert float(np.mean(results[0].output().argmax(axis=1) == y)) > 0.9
        with pytest.raises(errors.BadTensor):
            client.infer(TASK, x[:, :10], latency_ms=2000)
    assert client.state == "closed"
    with pytest.raises(RuntimeError):
        client.ready()
    leftover = [t for t in threading.enumerate() if t not in before and t.name != "onnx-dp_0"]
    assert not leftover, leftover
