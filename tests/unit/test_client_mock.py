"""The SDK against ``MockTransport``: request encoding, error mapping, lifecycle, the sync wrapper."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import numpy as np
import pytest

from mesh import errors
from mesh.client import AsyncClient, Client, InferResult
from mesh.sdk_transport import MockTransport, Response
from mesh.types import TaskSignature, TensorSpec, Timing
from mesh.v2 import codec as codec
from mesh.v2.body import HEADER_LENGTH, TENANT_HEADER
from mesh.v2.params import signature_to_metadata

pytestmark = pytest.mark.unit

SIG = TaskSignature("digit-classification", (TensorSpec("x", "float32", (-1, 64)),),
                    (TensorSpec("logits", "float32", (-1, 10)),))


class Server:
    """A pure function that answers like the edge agent: doubles the input's row sums as logits."""

    def __init__(self, extra: dict[str, object] | None = None) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.extra = extra or {}

    def __call__(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        self.seen.append((method, path, headers, body))
        if path == "v2/health/ready":
            return 200, {}, b"{}"
        if path == "v2/models/digit-classification":
            return 200, {}, json.dumps(signature_to_metadata(SIG)).encode()
        if path == "v2/models/digit-classification/infer":
            hlen = headers.get(HEADER_LENGTH)
            dec = codec.decode_infer_request(body, int(hlen) if hlen else None)
            x = dec.inputs["x"]
            logits = np.repeat(x.sum(axis=1, keepdims=True) * 2, 10, axis=1)
            params = {"site": "edge-a", "variant": "mlp.fp32", "accuracy": 0.97, "reason": "local_ok",
                      "best_effort": False, "tenant": headers[TENANT_HEADER],
                      "timing_ms_network": 0.5, "timing_ms_queue": 0.25, "timing_ms_compute": 1.0,
                      "timing_ms_total": 2.0, "hops": "edge-a", **self.extra}
            out, rl = codec.encode_infer_response("digit-classification", dec.request_id or "gen", {
                "logits": logits}, params, {"logits": dec.binary_default})
            return 200, ({"inference-header-content-length": str(rl)} if rl else {}), out
        return 404, {}, json.dumps({"error": "no task", "code": "unknown_task"}).encode()


async def test_infer_with_bare_array_fetches_and_caches_metadata() -> None:
    server = Server()
    x = np.random.default_rng(0).random((3, 64)).astype(np.float32)
    async with AsyncClient("http://edge", tenant="acme", transport=MockTransport(server)) as c:
        r1 = await c.infer("digit-classification", x, latency_ms=20, min_accuracy=0.9, max_cost=3,
                           prefer="accuracy", request_id="q1")
        r2 = await c.infer("digit-classification", x, latency_ms=20)
    paths = [p for _, p, _, _ in server.seen]
    assert paths.count("v2/models/digit-classification") == 1  # cached
    assert isinstance(r1, InferResult) and r1.request_id == "q1" and r2.request_id == "gen"
    want = np.repeat(x.sum(axis=1, keepdims=True) * 2, 10, axis=1)
    np.testing.assert_allclose(r1.output(), want, rtol=1e-6)
    assert (r1.site, r1.variant, r1.accuracy, r1.tenant, r1.hops) == ("edge-a", "mlp.fp32", 0.97, "acme",
                                                                      ["edge-a"])
    assert r1.timing == Timing(0.5, 0.25, 1.0, 2.0)
    _, _, headers, body = server.seen[1]
    assert headers[TENANT_HEADER] == "acme"
    sent = json.loads(body[:int(headers[HEADER_LENGTH])])
    assert sent["id"] == "q1"
    assert sent["parameters"] == {"latency_ms": 20, "min_accuracy": 0.9, "prefer": "accuracy", "max_cost": 3,
                                  "binary_data_output": True}


async def test_json_mode_sends_no_binary() -> None:
    server = Server()
    x = np.ones((1, 64), np.float32)
    async with AsyncClient("http://edge", transport=MockTransport(server), binary=False) as c:
        r = await c.infer("digit-classification", {"x": x}, latency_ms=5)
    _, _, headers, body = server.seen[-1]
    assert HEADER_LENGTH not in headers and json.loads(body)["inputs"][0]["data"][:2] == [1.0, 1.0]
    assert r.output("logits").shape == (1, 10)


ERROR_CODES = [(cls.code, cls) for cls in (
    errors.UnknownTask, errors.UnknownTenant, errors.BadTensor, errors.PayloadTooLarge, errors.ImpossibleSLO,
    errors.DeadlineExceeded, errors.Overloaded, errors.NoRoute, errors.PeerUnavailable, errors.RequestError)]


@pytest.mark.parametrize("code, cls", ERROR_CODES)
async def test_error_bodies_map_to_error_classes(code: str, cls: type[errors.MeshError]) -> None:
    def handler(*_: Any) -> Response:
        return cls.http_status, {}, json.dumps({"error": f"boom {code}", "code": code}).encode()

    async with AsyncClient("http://edge", transport=MockTransport(handler)) as c:
        with pytest.raises(cls, match=f"boom {code}") as info:
            await c.infer("digit-classification", {"x": np.zeros((1, 64), np.float32)}, latency_ms=5)
    assert type(info.value) is cls


async def test_non_json_error_body_is_a_mesh_error() -> None:
    transport = MockTransport(lambda *_: (502, {}, b"<html>bad gw"))
    async with AsyncClient("http://edge", transport=transport) as c:
        with pytest.raises(errors.MeshError, match="HTTP 502"):
            await c.task_metadata("digit-classification")


async def test_ready_false_on_503_and_errors_propagate() -> None:
    async with AsyncClient("http://edge", transport=MockTransport(lambda *_: (503, {}, b"{}"))) as c:
        assert await c.ready() is False

    def down(*_: Any) -> Response:
        raise errors.PeerUnavailable("connection refused")

    async with AsyncClient("http://edge", transport=MockTransport(down)) as c:
        with pytest.raises(errors.PeerUnavailable):
            await c.ready()


async def test_slow_server_gives_deadline_exceeded() -> None:
    async def slow(*_: Any) -> Response:
        await asyncio.sleep(5)
        return 200, {}, b"{}"

    async with AsyncClient("http://edge", timeout=0.05, transport=MockTransport(slow)) as c:
        with pytest.raises(errors.DeadlineExceeded):
            await c.ready()


async def test_multi_input_task_needs_a_dict() -> None:
    sig2 = TaskSignature("pair", (TensorSpec("a", "float32", (-1,)), TensorSpec("b", "float32", (-1,))), ())

    def handler(*_: Any) -> Response:
        return 200, {}, json.dumps(signature_to_metadata(sig2)).encode()

    async with AsyncClient("http://edge", transport=MockTransport(handler)) as c:
        with pytest.raises(errors.BadTensor, match="pass a dict"):
            await c.infer("pair", np.zeros(3, np.float32), latency_ms=5)


async def test_lifecycle_states_and_closed_client_raises() -> None:
    transport = MockTransport(Server())
    c = AsyncClient("http://edge", transport=transport)
    assert c.state == "unopened"
    assert await c.ready() is True
    assert c.state == "open"
    await c.aclose()
    await c.aclose()  # idempotent
    assert c.state == "closed" and transport.closed
    with pytest.raises(RuntimeError, match="closed"):
        await c.ready()
    with pytest.raises(RuntimeError, match="closed"):
        async with c:
            pass


def test_result_output_requires_name_when_several() -> None:
    r = InferResult({"a": np.zeros(1), "b": np.ones(1)}, "s", "v", 0.9, "ok", False, "t", Timing())
    assert r.output("b")[0] == 1.0
    with pytest.raises(KeyError):
        r.output()


def test_sync_client_runs_one_loop_thread_and_stops_it() -> None:
    server = Server()
    before = {t.ident for t in threading.enumerate()}
    x = np.zeros((2, 64), np.float32)
    with Client("http://edge", transport=MockTransport(server)) as c:
        assert c.ready() is True
        assert c.task_metadata("digit-classification") == SIG
        for _ in range(3):
            assert c.infer("digit-classification", x, latency_ms=10).output().shape == (2, 10)
        workers = [t for t in threading.enumerate() if t.name == "tiermesh-client"]
        assert len(workers) == 1
        with pytest.raises(errors.UnknownTask):
            c.infer("nope", {"x": x}, latency_ms=10)
    assert {t.ident for t in threading.enumerate()} <= before
    assert c.state == "closed"
    with pytest.raises(RuntimeError, match="closed"):
        c.ready()
    c.close()  # idempotent


async def test_sync_client_close_inside_a_running_loop() -> None:
    transport = MockTransport(Server())
    c = Client("http://edge", transport=transport)
    c.close()  # never used, called from a coroutine: must not need asyncio.run
    assert transport.closed


async def test_infer_is_bounded_by_its_budget_not_only_the_client_timeout() -> None:
    """An agent that never answers: the call fails near budget + grace, not at the 30 s client timeout."""
    import time

    from mesh import client as client_mod

    async def hang(method: str, path: str, headers: Any, body: bytes) -> Any:
        if path.endswith("/infer"):
            await asyncio.sleep(60)
        return 200, {}, json.dumps(signature_to_metadata(
            TaskSignature("t", (TensorSpec("x", "float32", (-1, 4)),), (TensorSpec("y", "float32", (-1, 2)),))
        )).encode()

    old = client_mod.DEADLINE_GRACE_S
    client_mod.DEADLINE_GRACE_S = 0.2
    try:
        async with AsyncClient("http://edge", transport=MockTransport(hang), timeout=30) as c:
            t0 = time.perf_counter()
            with pytest.raises(errors.DeadlineExceeded):
                await c.infer("t", np.zeros((1, 4), np.float32), latency_ms=100)
            assert time.perf_counter() - t0 < 5
    finally:
        client_mod.DEADLINE_GRACE_S = old


async def test_the_budget_bounds_the_whole_call_metadata_lookup_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first call looks the task's signature up first: at a busy edge that takes time, and the caller's
    wait is still budget + grace from its call (the chaos suite's bursts saw answers 1.3 s into a 0.3 s
    budget: a slow lookup, then a full request bound)."""
    import time

    from mesh import client as client_mod

    monkeypatch.setattr(client_mod, "DEADLINE_GRACE_S", 0.2)

    async def slow(method: str, path: str, headers: Any, body: bytes) -> Any:
        await asyncio.sleep(0.25)
        if path.endswith("/infer"):
            return 200, {}, codec.encode_infer_response("t", "q", {"y": np.zeros((1, 2), np.float32)}, {},
                                                        False)[0]
        return 200, {}, json.dumps(signature_to_metadata(
            TaskSignature("t", (TensorSpec("x", "float32", (-1, 4)),), (TensorSpec("y", "float32", (-1, 2)),))
        )).encode()

    async with AsyncClient("http://edge", transport=MockTransport(slow), timeout=30) as c:
        t0 = time.perf_counter()
        with pytest.raises(errors.DeadlineExceeded):
            await c.infer("t", np.zeros((1, 4), np.float32), latency_ms=100)  # bound 0.3 s: 0.25 + 0.25 is late
        assert time.perf_counter() - t0 < 0.45


@pytest.mark.parametrize(("header", "expected"), [("7", 7), ("  12 ", 12), ("Wed, 21 Oct 2026 07:28:00 GMT", 1),
                                                  (None, 1)])
async def test_quota_exceeded_carries_the_servers_retry_after(header: str | None, expected: int) -> None:
    """A 429's ``Retry-After`` (delay seconds) reaches ``QuotaExceeded.retry_after_s``; a date form or none
    leaves the 1 s floor."""
    server = Server()

    def over_quota(method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        if path.endswith("/infer"):
            extra = {"Retry-After": header} if header is not None else {}
            return 429, extra, json.dumps({"error": "acme over 5 q/s", "code": "quota_exceeded"}).encode()
        return server(method, path, headers, body)

    async with AsyncClient("http://edge", tenant="acme", transport=MockTransport(over_quota)) as c:
        with pytest.raises(errors.QuotaExceeded) as info:
            await c.infer("digit-classification", np.zeros((1, 64), np.float32), latency_ms=20)
    assert info.value.retry_after_s == expected and info.value.http_status == 429


async def test_the_result_says_when_a_backbone_was_shared() -> None:
    x = np.zeros((1, 64), np.float32)
    shared = Server({"shared_backbone": True, "backbone_batch_tenants": 3})
    async with AsyncClient("http://edge", transport=MockTransport(shared)) as c:
        assert (await c.infer("digit-classification", x, latency_ms=20)).backbone_tenants == 3
    async with AsyncClient("http://edge", transport=MockTransport(Server())) as c:
        assert (await c.infer("digit-classification", x, latency_ms=20)).backbone_tenants == 0
