"""The console's pipelines view on a real etcd, through a real console server (issue 33 item 3): ``/api/pipelines``
lists each pipeline the catalog declares (``pipelines/<task>``, as the console's view follows it) with the queries its
doors ran by outcome, per site and in all, and each stage's p50 / p95 latency from the histogram buckets summed over
two live agents (aiohttp servers answering ``/metrics`` with a real ``AgentMetrics`` exposition); behind the admin
gate like every other route."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from console import ConsoleServer
from edge_agent.metrics import AgentMetrics
from mesh.errors import DeadlineExceeded
from mesh.etcd.keys import pipeline_key
from mesh.etcd.store import Store
from mesh.types import InferResponse, StageInfo, TaskSignature, TensorSpec
from tests.helpers.console_stub import console_with_agents
from tests.integration.test_console_builds_cascades import AUTH, _get
from tests.integration.test_console_server import TOKEN, TOPOLOGY
from variant_store.pipeline_meta import PipelineMeta, Stage

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
TASK = "text-section"
SIG = TaskSignature(TASK, (TensorSpec("x", "float32", (-1, 4)),), (TensorSpec("y", "float32", (-1, 3)),))
META = PipelineMeta(task=TASK, kind="sequence", signature=SIG,
                    stages=(Stage("embed", (("x", "input.x"),)), Stage("topic", (("x", "prev.y"),))))
# site -> (answered queries: (embed ms, topic ms)), failed queries
RAN = {"edge-a": (((2.0, 30.0),) * 9, 1), "core": (((2.0, 300.0),), 0)}


def _metrics_text(site: str) -> bytes:
    m = AgentMetrics(site)
    m.known(tasks=["embed", "topic"], tenants=["acme"], variants=["v"], sites=list(RAN))
    answered, failed = RAN[site]
    for embed_ms, topic_ms in answered:
        stages = (StageInfo(1, site, "v", 1, 1, (), embed_ms, 1.0, "embed"),
                  StageInfo(2, site, "v", 1, 1, (), topic_ms, 1.0, "topic"))
        m.pipeline(TASK, InferResponse("r", {}, site, "v", 0.0, "pipeline", stages=stages, cascade=TASK))
    for _ in range(failed):
        m.pipeline(TASK, DeadlineExceeded("stage 2 ran out of budget"))
    return m.render()


@pytest.fixture
async def console(store: Store) -> AsyncIterator[ConsoleServer]:
    await store.put(pipeline_key(TASK), META.to_json())
    agents = {site: (tier, _metrics_text(site)) for site, tier in (("edge-a", "edge"), ("core", "core"))}
    async with console_with_agents(store, TOPOLOGY, TOKEN, agents) as server:
        yield server


async def test_the_pipelines_view_shows_outcomes_and_stage_latency(console: ConsoleServer) -> None:
    deadline = asyncio.get_running_loop().time() + 10.0
    while True:  # the console's view learns the pipeline and both agents' live records within a tick or two
        status, body = await _get(console.url + "/api/pipelines", headers=AUTH)
        assert status == 200
        if not body["tasks"] or body["tasks"][0]["queries"] < 11 or body["tasks"][0]["kind"] is None:
            assert asyncio.get_running_loop().time() < deadline, body
            await asyncio.sleep(0.2)
            continue
        break
    (task,) = body["tasks"]
    assert (task["task"], task["kind"], task["declared"], task["accuracy"]) == (TASK, "sequence",
                                                                                 ["embed", "topic"], None)
    assert task["outcomes"] == {"deadline": 1, "ok": 10}
    assert task["sites"] == [{"site": "core", "queries": 1, "outcomes": {"ok": 1}},
                             {"site": "edge-a", "queries": 10, "outcomes": {"deadline": 1, "ok": 9}}]
    stages: dict[tuple[str, str], Any] = {(s["stage"], s["stage_task"]): s for s in task["stages"]}
    assert list(stages) == [("1", "embed"), ("2", "topic")]
    embed, topic = stages[("1", "embed")], stages[("2", "topic")]
    assert embed["count"] == topic["count"] == 10
    assert 1.0 < embed["p50_ms"] <= embed["p95_ms"] <= 2.5
    assert 20.0 < topic["p50_ms"] <= 50.0 < 200.0 < topic["p95_ms"] <= 500.0  # the core's slow stage is the tail
    assert topic["mean_ms"] == pytest.approx(57.0)
    assert body["scrape_errors"] == {}


async def test_the_admin_gate_holds(console: ConsoleServer) -> None:
    for headers in ({}, {"Authorization": "Bearer " + "x" * 32}):
        async with aiohttp.ClientSession() as s, s.get(console.url + "/api/pipelines", headers=headers) as resp:
            assert resp.status == 401, headers
