"""The console's builds and cascades views on a real etcd, through a real console server (issues 34 and 33):
``/api/builds`` lists each tenant's builds by state with their progress and measured variants, from the records a
door (``BuildBook``) and the variant store (``buildstate/``) write; a tampered record is left out, not fatal.
``/api/cascades`` lists the catalogued cascades, a malformed entry as broken with its reason, joined with the
escalation a live agent counted (an aiohttp server answering ``/metrics`` with a real ``AgentMetrics``
exposition). Both sit behind the admin gate like every other route."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from console import ConsoleConfig, ConsoleServer
from core_scheduler.state.builds import BuildBook
from core_scheduler.state.heartbeat import Heartbeat
from edge_agent.cascade_exec import ESCALATED, LOCAL
from edge_agent.metrics import AgentMetrics
from mesh.buildspec import BuildRequest, BuildState, VariantResult
from mesh.etcd.keys import build_key, build_state_key, cascade_key, live_key
from mesh.etcd.store import Store
from mesh.types import InferResponse, StageInfo
from tests.helpers.http_stub import metrics_app, serve_app
from tests.integration.test_console_server import TOKEN, TOPOLOGY
from topology.loader import parse_topology
from topology.store_io import apply
from variant_store.cascade_meta import CascadeMeta

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TASK = "digit-classification"


def _metrics_text() -> bytes:
    """What a door that ran the cascade 4 times (1 escalated) serves at /metrics."""
    m = AgentMetrics("edge-a")
    m.known(tasks=[TASK], tenants=["acme"], variants=["mlp-tiny.onnx.int8", "mlp-wide.onnx.fp32"],
            sites=["edge-a", "core"])
    one = StageInfo(1, "edge-a", "mlp-tiny.onnx.int8", 1, 1, (0.99,))
    for reason, stages in ((LOCAL, (one,)), (LOCAL, (one,)), (LOCAL, (one,)),
                           (ESCALATED, (StageInfo(1, "edge-a", "mlp-tiny.onnx.int8", 1, 0, (0.4,)),
                                        StageInfo(2, "core", "mlp-wide.onnx.fp32", 1, 1)))):
        m.cascade(TASK, InferResponse("r", {}, "edge-a", "mlp-tiny.onnx.int8", 0.9, reason, stages=stages))
    return m.render()


@pytest.fixture
async def agent() -> AsyncIterator[str]:
    async with serve_app(metrics_app(_metrics_text())) as url:
        yield url


@pytest.fixture
async def console(store: Store, agent: str) -> AsyncIterator[ConsoleServer]:
    await apply(store, parse_topology(TOPOLOGY), source=TOPOLOGY)
    await store.put(live_key("edge-a"), Heartbeat(site="edge-a", http=agent, tier="edge", capacity=8).to_json())
    server = ConsoleServer(store, ConsoleConfig(token=TOKEN, tick_s=0.2))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _get(url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


def _request(tenant: str, task: str, created: float) -> BuildRequest:
    return BuildRequest(build_id=uuid.uuid4().hex, tenant=tenant, task=task, family=f"{task}-fam",
                        model_digest="a" * 64, model_bytes=2048, validation_digest="b" * 64, validation_bytes=512,
                        rows=200, door="edge-a", created=created)


async def test_the_builds_view_shows_state_progress_and_results(store: Store, console: ConsoleServer) -> None:
    status, empty = await _get(console.url + "/api/builds", headers=AUTH)
    assert status == 200 and [t["tenant"] for t in empty["tenants"]] == ["acme", "globex"]
    assert all(t["builds"] == [] and sum(t["counts"].values()) == 0 for t in empty["tenants"])

    book, now = BuildBook(store), time.time()
    queued, running, done = _request("acme", "q", now - 3), _request("acme", "r", now - 2), _request("acme", "d", now)
    failed = _request("globex", "f", now - 1)
    for req in (queued, running, done, failed):
        await book.create(req)
    res = VariantResult("d-fam.onnx.int8", "onnx", "int8", 0.912, 1500, {"cpu-small": {1: 0.8, 8: 2.0}})
    for st in (BuildState(running.build_id, "acme", "running", stage="building", progress=0.5, updated=now),
               BuildState(done.build_id, "acme", "done", stage="done", progress=1.0, variants=(res,), updated=now),
               BuildState(failed.build_id, "globex", "failed", error="custom op 'Evil' is not allowed",
                          reason="custom_op", updated=now)):
        await store.put(build_state_key(st.build_id), st.to_json())
    tampered = _request("acme", "t", now)  # a request whose key names another tenant: nobody's build
    await store.put(build_key("acme", tampered.build_id), {**tampered.to_json(), "tenant": "globex"})
    await store.put(build_key("acme", uuid.uuid4().hex), {"schema": 1, "rows": -1})

    status, body = await _get(console.url + "/api/builds", headers=AUTH)
    assert status == 200
    acme, globex = body["tenants"]
    assert acme["counts"] == {"queued": 1, "running": 1, "done": 1, "failed": 0}
    assert globex["counts"] == {"queued": 0, "running": 0, "done": 0, "failed": 1}
    assert [b["id"] for b in acme["builds"]] == [done.build_id, running.build_id, queued.build_id]  # newest first
    d, r, q = acme["builds"]
    assert (r["state"], r["stage"], r["progress"]) == ("running", "building", 0.5)
    assert (q["state"], q["progress"], q["task"], q["family"]) == ("queued", 0.0, "q", "q-fam")
    (v,) = d["variants"]
    assert (v["variant"], v["accuracy"], v["size_bytes"], v["p50_ms"]) == ("d-fam.onnx.int8", 0.912, 1500,
                                                                            {"cpu-small": 0.8})
    (f,) = globex["builds"]
    assert (f["state"], f["reason"]) == ("failed", "custom_op") and "Evil" in f["error"]

    status, only = await _get(console.url + "/api/builds", params={"tenant": "globex"}, headers=AUTH)
    assert status == 200 and [t["tenant"] for t in only["tenants"]] == ["globex"]
    assert [b["id"] for b in only["tenants"][0]["builds"]] == [failed.build_id]
    status, missing = await _get(console.url + "/api/builds", params={"tenant": "initech"}, headers=AUTH)
    assert status == 404 and "initech" in missing["error"]


def _cascade(cid: str, escalation: float) -> CascadeMeta:
    return CascadeMeta(task=TASK, cascade_id=cid, stages=("mlp-tiny.onnx.int8", "mlp-wide.onnx.fp32"),
                       rule="max_softmax", thresholds=(0.85,), accuracy=0.975, escalation=(escalation,),
                       target_accuracy=0.97, calibration_rows=250, heldout_rows=250, created=time.time())


async def test_the_cascades_view_joins_the_catalog_with_live_escalation(store: Store,
                                                                       console: ConsoleServer) -> None:
    await store.put(cascade_key(TASK, "cascade-a"), _cascade("cascade-a", 0.22).to_json())
    await store.put(cascade_key(TASK, "cascade-broken"), {**_cascade("cascade-broken", 0.2).to_json(),
                                                          "rule": "coin_flip"})
    await store.put(cascade_key(TASK, "elsewhere"), _cascade("cascade-a", 0.2).to_json())  # names another id
    deadline = asyncio.get_running_loop().time() + 10.0
    while True:  # the console's view learns the agent's live record within a tick or two
        status, body = await _get(console.url + "/api/cascades", headers=AUTH)
        assert status == 200
        if (body["tasks"] and body["tasks"][0]["sites"]) or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.2)
    (task,) = body["tasks"]
    assert task["task"] == TASK
    (c,) = task["cascades"]
    assert (c["id"], c["stages"], c["thresholds"], c["accuracy"], c["escalation"]) == \
        ("cascade-a", ["mlp-tiny.onnx.int8", "mlp-wide.onnx.fp32"], [0.85], 0.975, [0.22])
    (site,) = task["sites"]
    assert (site["site"], site["local"], site["escalated"], site["queries"]) == ("edge-a", 3, 1, 4)
    assert site["escalation_rate"] == 0.25 and site["rows"] == {"1": 3, "2": 1}
    assert task["escalation_rate"] == 0.25
    broken = {b["name"]: b["reason"] for b in body["broken"]}
    assert set(broken) == {"cascade-broken", "elsewhere"}
    assert "rule" in broken["cascade-broken"] and "not its key" in broken["elsewhere"]
    assert body["scrape_errors"] == {}


@pytest.mark.parametrize("path", ["/api/builds", "/api/cascades", "/api/builds?tenant=acme"])
async def test_the_admin_gate_holds(console: ConsoleServer, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer " + "x" * 32}):
        async with aiohttp.ClientSession() as s, s.get(console.url + path, headers=headers) as resp:
            assert resp.status == 401, (path, headers)
