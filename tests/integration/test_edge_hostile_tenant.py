"""A hostile tenant at an edge agent's door (issue 29), on loopback with a real ONNX data plane: another tenant's
private task looks exactly like one that does not exist, an over-quota caller is refused before its body is read,
an SLO past its bound is a 400, a tenant reads only its own traces even under an id another tenant chose, and an
edge without TLS refuses an ambiguous tenant header and keeps ``/metrics``, traces and ``/blobs`` from callers the
header names."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from edge_agent.dataplane import task_visible
from edge_agent.http_api import EdgeHttpServer
from edge_agent.metrics import AgentMetrics
from edge_agent.mtls import EdgeTls
from edge_agent.observe import Observe
from edge_agent.traces import TraceStore
from mesh.errors import QuotaExceeded, UnknownTask
from mesh.pki.identity import Identity
from mesh.types import InferRequest, InferResponse, TaskSignature
from mesh.v2.body import TENANT_HEADER
from tests.helpers.mtls_edge import ACME, GLOBEX, SITE, TASK, make_pki, tenant_context
from tests.helpers_dataplane import OnnxDataPlane, digits_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PRIVATE = "acme-digits"  # acme's private task: the same model, registered with acme as its only owner
OWNERS = {TASK: ["public"], PRIVATE: ["acme"]}
IO = aiohttp.ClientTimeout(total=15)


class TwoTasks(OnnxDataPlane):
    """A public task and acme's private one, answering as the site data plane does: its words for a task it
    does not know list the tasks it knows, and the routing policy names the tenant a task is hidden from."""

    def task_signature(self, task: str) -> TaskSignature:
        if task not in OWNERS:
            raise UnknownTask(f"unknown task {task!r}; known: {sorted(OWNERS)}")
        return TaskSignature(task, self.signature.inputs, self.signature.outputs)

    def tasks(self) -> list[str]:
        return sorted(OWNERS)

    async def infer(self, req: InferRequest) -> InferResponse:
        if not task_visible(OWNERS.get(req.task, ()), req.tenant):
            raise UnknownTask(f"no variant of task {req.task!r} is visible to tenant {req.tenant!r}", task=req.task)
        req.task = TASK
        return await super().infer(req)


def visible(task: str, tenant: str) -> bool:
    return task_visible(OWNERS.get(task, ()), tenant)


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoTasks]:
    plane = TwoTasks(SITE.name, digits_model(tmp_path_factory.mktemp("model")), accuracy=0.96)
    try:
        yield plane
    finally:
        plane.close()


def _infer_body(x: np.ndarray, name: str = "x", **params: Any) -> dict[str, Any]:
    return {"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}],
            "parameters": {"latency_ms": 2000, **params}}


async def _answer(s: aiohttp.ClientSession, method: str, path: str, tenant: str,
                  body: dict[str, Any] | None = None) -> tuple[int, str]:
    async with s.request(method, path, json=body, headers={TENANT_HEADER: tenant}) as resp:
        return resp.status, await resp.text()


# ------------------------------------------------------------------ item 7 (private tasks)

async def test_a_private_task_looks_exactly_like_one_that_does_not_exist(dp: TwoTasks) -> None:
    x = np.full((1, 64), 0.5, np.float32)
    good, odd_shape, odd_name = _infer_body(x), _infer_body(np.ones((1, 3), np.float32)), _infer_body(x, "y")
    asks: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/v2/models/{t}", None), ("GET", "/v2/models/{t}/versions/1", None),
        ("GET", "/v2/models/{t}/ready", None), ("GET", "/v2/models/{t}/versions/1/ready", None),
        ("POST", "/v2/models/{t}/infer", good), ("POST", "/v2/models/{t}/infer", odd_shape),
        ("POST", "/v2/models/{t}/infer", odd_name), ("POST", "/v2/models/{t}/versions/1/infer", good),
        ("POST", "/v2/models/{t}/infer", {"inputs": "junk"}), ("GET", "/v2/models/{t}/infer", None),
        ("POST", "/v2/models/{t}", good), ("GET", "/v2/repository/models/{t}", None),
        ("POST", "/v2/repository/models/{t}/load", None)]
    async with EdgeHttpServer(dp, visible=visible) as srv, aiohttp.ClientSession(srv.url, timeout=IO) as s:
        for method, path, body in asks:
            private = await _answer(s, method, path.format(t=PRIVATE), "globex", body)
            missing = await _answer(s, method, path.format(t="no-such-task"), "globex", body)
            assert private[0] == missing[0], (method, path, private, missing)
            assert private[1].replace(PRIVATE, "T") == missing[1].replace("no-such-task", "T"), (method, path)
            assert PRIVATE not in missing[1] and "known:" not in private[1], (method, path, private, missing)
        # the owner sees and uses its task; another tenant's infer by a bare attempt is the 404 of no task
        assert (await _answer(s, "GET", f"/v2/models/{PRIVATE}", "acme"))[0] == 200
        status, text = await _answer(s, "POST", f"/v2/models/{PRIVATE}/infer", "acme", good)
        assert status == 200, text
        status, text = await _answer(s, "GET", f"/v2/models/{PRIVATE}", "globex")
        assert (status, json.loads(text)) == (404, {"code": "unknown_task", "error": f"unknown task {PRIVATE!r}"})
        assert (await _answer(s, "GET", f"/v2/models/{TASK}", "globex"))[0] == 200  # public: everyone's


async def test_the_data_planes_own_words_are_not_passed_on(dp: TwoTasks) -> None:
    """Without ``visible`` (a data plane that decides alone), its refusals still reach the caller in the one
    wording: not the list of known tasks, not whose a task is."""
    async with EdgeHttpServer(dp) as srv, aiohttp.ClientSession(srv.url, timeout=IO) as s:
        status, text = await _answer(s, "GET", "/v2/models/no-such-task", "globex")
        assert (status, json.loads(text)) == (404, {"code": "unknown_task", "error": "unknown task 'no-such-task'"})
        body = _infer_body(np.full((1, 64), 0.5, np.float32))
        status, text = await _answer(s, "POST", f"/v2/models/{PRIVATE}/infer", "globex", body)
        assert (status, json.loads(text)) == (404, {"code": "unknown_task", "error": f"unknown task {PRIVATE!r}"})


# ------------------------------------------------------------------ item 7 (over quota: before the body)

async def test_an_over_quota_tenant_is_refused_before_its_body_is_read(dp: TwoTasks) -> None:
    def quota_check(tenant: str) -> None:
        if tenant == "mallory":
            raise QuotaExceeded(f"tenant {tenant!r} is over its rate at this door", retry_after_s=3)

    calls = dp.calls
    async with EdgeHttpServer(dp, quota_check=quota_check) as srv:
        host, port = srv.host, srv.port
        reader, writer = await asyncio.open_connection(host, port)
        try:
            # 8 MB announced (under the 16 MB limit), none of it sent: only a refusal before the body can answer
            writer.write(f"POST /v2/models/{TASK}/infer HTTP/1.1\r\nHost: edge\r\n{TENANT_HEADER}: mallory\r\n"
                         f"Content-Type: application/json\r\nContent-Length: 8000000\r\n\r\n".encode())
            await writer.drain()
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
        finally:
            writer.close()
        assert head.startswith(b"HTTP/1.1 429"), head
        assert b"retry-after: 3" in head.lower(), head
        async with aiohttp.ClientSession(srv.url, timeout=IO) as s:  # everyone else is served
            status, text = await _answer(s, "POST", f"/v2/models/{TASK}/infer", "acme",
                                         _infer_body(np.full((1, 64), 0.5, np.float32)))
            assert status == 200, text
    assert dp.calls == calls + 1  # mallory's query never reached the data plane


# ------------------------------------------------------------------ item 7 (SLO bound)

@pytest.mark.parametrize("latency_ms", [600_001, 1e12, 1e300])
async def test_an_slo_past_its_bound_is_a_400(dp: TwoTasks, latency_ms: float) -> None:
    async with EdgeHttpServer(dp) as srv, aiohttp.ClientSession(srv.url, timeout=IO) as s:
        status, text = await _answer(s, "POST", f"/v2/models/{TASK}/infer", "acme",
                                     _infer_body(np.full((1, 64), 0.5, np.float32), latency_ms=latency_ms))
        assert status == 400, text
        assert json.loads(text)["code"] == "bad_request" and "latency_ms must be at most 600000" in text


# ------------------------------------------------------------------ item 2 (traces, over TLS)

@pytest.fixture
async def tls_edge(dp: TwoTasks, tmp_path: Path) -> AsyncIterator[tuple[str, Any, TraceStore]]:
    pki = make_pki(tmp_path)
    pki.issue(Identity("admin", "ops"))
    traces = TraceStore(100)
    tls = EdgeTls(pki.paths, SITE.name, interval_s=0.2)
    async with EdgeHttpServer(dp, tls=tls, observe=Observe(AgentMetrics(SITE.name), traces, tls)) as srv:
        yield srv.url, pki, traces


async def _get(url: str, ctx: ssl.SSLContext, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, force_close=True), timeout=IO) as s, \
            s.get(url, headers=headers) as resp:
        return resp.status, json.loads(await resp.read())


async def test_a_tenant_reads_only_its_own_trace_under_an_id_another_chose(
        tls_edge: tuple[str, Any, TraceStore]) -> None:
    url, pki, traces = tls_edge
    traces.add("r-1", "a" * 32, "acme", TASK, "ok", [])
    traces.add("r-1", "b" * 32, "globex", TASK, "ok", [])  # globex reuses acme's id: it overwrites nothing
    acme, globex = tenant_context(pki, ACME), tenant_context(pki, GLOBEX)
    admin = tenant_context(pki, Identity("admin", "ops"))
    assert (await _get(f"{url}/v2/traces/r-1", acme))[1]["trace_id"] == "a" * 32
    assert (await _get(f"{url}/v2/traces/r-1", globex))[1]["trace_id"] == "b" * 32
    assert (await _get(f"{url}/v2/traces/r-1?tenant=globex", acme))[1]["trace_id"] == "a" * 32  # own only
    assert (await _get(f"{url}/v2/traces/r-1?tenant=acme", admin))[1]["trace_id"] == "a" * 32
    assert (await _get(f"{url}/v2/traces/r-1", admin))[1]["tenant"] == "globex"  # the newest
    status, body = await _get(f"{url}/v2/traces?limit=10", acme)
    assert status == 200 and [t["tenant"] for t in body["traces"]] == ["acme"]
    # the tenant header once, one name: with a certificate too
    status, body = await _get(f"{url}/v2/models/{TASK}", acme, {TENANT_HEADER: "acme, globex"})
    assert (status, body["code"]) == (400, "bad_request")


# ------------------------------------------------------------------ item 7 (--no-edge-tls)

@pytest.fixture
async def plain_edge(dp: TwoTasks, tmp_path: Path) -> AsyncIterator[str]:
    from edge_agent.blobs import blob_routes

    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / ("ab" * 32 + ".onnx")).write_bytes(b"model bytes")
    traces = TraceStore(100)
    traces.add("r-1", "a" * 32, "acme", TASK, "ok", [])
    async with EdgeHttpServer(dp, observe=Observe(AgentMetrics(SITE.name), traces),
                              routes=tuple(blob_routes(tmp_path / "blobs", None, lambda digest: True))) as srv:
        yield srv.url


async def test_without_tls_the_tenant_header_counts_once(plain_edge: str) -> None:
    body = _infer_body(np.full((1, 64), 0.5, np.float32))
    async with aiohttp.ClientSession(plain_edge, timeout=IO) as s:
        for headers in ([(TENANT_HEADER, "globex"), (TENANT_HEADER, "acme")],
                        [(TENANT_HEADER, "acme"), (TENANT_HEADER, "acme")], [(TENANT_HEADER, "acme,globex")]):
            async with s.post(f"/v2/models/{TASK}/infer", json=body, headers=headers) as resp:
                assert resp.status == 400, headers
                assert f"header {TENANT_HEADER} must name one tenant once" in (await resp.json())["error"]
        async with s.post(f"/v2/models/{TASK}/infer", json=body, headers={TENANT_HEADER: "acme"}) as resp:
            assert resp.status == 200 and (await resp.json())["parameters"]["tenant"] == "acme"


async def test_without_tls_metrics_traces_and_blobs_need_a_certificate(plain_edge: str) -> None:
    paths = ["/metrics", "/v2/traces?limit=5", "/v2/traces/r-1", f"/blobs/{'ab' * 32}"]
    async with aiohttp.ClientSession(plain_edge, timeout=IO) as s:
        for path in paths:
            async with s.get(path, headers={TENANT_HEADER: "acme"}) as resp:
                assert resp.status == 403, path
                body = await resp.json()
                assert body["code"] == "forbidden" and "need a client certificate" in body["error"], body
            async with s.get(path) as resp:  # the operator on the agent's own network, as before
                assert resp.status == 200, path
