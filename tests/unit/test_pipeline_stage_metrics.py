"""A pipeline's metrics at the door that ran it (issue 33 item 3): queries by outcome and each stage's latency
(``edge_agent.metrics``), recorded by the data plane's ``_pipeline`` for an answer and for a failure, and the
console's summary of them (``console.pipelines``): per-stage p50 / p95 from the buckets summed over sites."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from console.digest import Sample, parse_samples
from console.pipelines import pipeline_counts, summary
from edge_agent.demand import DemandMeter
from edge_agent.metrics import LATENCY_BOUNDS_S, AgentMetrics
from edge_agent.site_dataplane import SiteDataPlane
from mesh.errors import DeadlineExceeded
from mesh.types import SLO, InferRequest, InferResponse, StageInfo, TaskSignature, TensorSpec, Timing
from tests.unit.test_paths_retry import FakeZmq
from variant_store.pipeline_meta import MAX_STAGES, PipelineMeta, Stage

pytestmark = pytest.mark.unit
QUERIES, STAGE = "tiermesh_pipeline_queries", "tiermesh_pipeline_stage_seconds"
SIG = TaskSignature("text-section", (TensorSpec("x", "float32", (-1, 2)),), (TensorSpec("y", "float32", (-1, 2)),))
META = PipelineMeta(task="text-section", kind="sequence",
                    stages=(Stage("embed", (("x", "input.x"),)), Stage("topic", (("x", "prev.y"),))), signature=SIG,
                    accuracy=0.75, heldout_rows=100)


def _answer(*stage_ms: tuple[int, str, float]) -> InferResponse:
    stages = tuple(StageInfo(k, "edge-a", "v", 1, 1, (), ms, ms / 2, task) for k, task, ms in stage_ms)
    return InferResponse("r", {}, "edge-a", "v", 0.75, "pipeline", stages=stages, cascade="text-section")


def _families(m: AgentMetrics) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def test_pipeline_families_count_outcomes_and_stage_latency_with_bounded_labels() -> None:
    m = AgentMetrics("edge-a")
    m.known(tasks=["embed", "topic"], tenants=[], variants=["v"], sites=[])
    fams = _families(m)
    assert fams[QUERIES].type == "counter" and fams[STAGE].type == "histogram"
    assert fams[QUERIES].samples == [] and fams[STAGE].samples == []  # present, empty, before any query
    m.pipeline("text-section", _answer((1, "embed", 3.0), (2, "topic", 40.0)))
    m.pipeline("text-section", _answer((1, "embed", 7.0), (2, "topic", 400.0)))
    m.pipeline("text-section", _answer((1, "embed", 0.2), (MAX_STAGES + 1, "mystery", 1.0)))  # bounded labels
    m.pipeline("text-section", DeadlineExceeded("stage 2 ran out"))
    m.pipeline("text-section", RuntimeError("a bug"))
    fams = _families(m)
    assert {(s.labels["task"], s.labels["site"], s.labels["outcome"]): s.value
            for s in fams[QUERIES].samples} == {("text-section", "edge-a", "ok"): 3,
                                                ("text-section", "edge-a", "deadline"): 1,
                                                ("text-section", "edge-a", "internal"): 1}
    counts = {(s.labels["task"], s.labels["stage"], s.labels["stage_task"]): s.value
              for s in fams[STAGE].samples if s.name == STAGE + "_count"}
    assert counts == {("text-section", "1", "embed"): 3, ("text-section", "2", "topic"): 2,
                      ("text-section", "other", "other"): 1}
    topic = {s.labels["le"]: s.value for s in fams[STAGE].samples
             if s.name == STAGE + "_bucket" and s.labels["stage"] == "2"}
    assert len(topic) == len(LATENCY_BOUNDS_S) + 1  # the module's latency buckets, and +Inf
    assert (topic["0.02"], topic["0.05"], topic["0.2"], topic["0.5"], topic["+Inf"]) == (0, 1, 1, 2, 2)
    (total,) = [s.value for s in fams[STAGE].samples if s.name == STAGE + "_sum" and s.labels["stage"] == "2"]
    assert math.isclose(total, 0.44)


def _sample(name: str, value: float, **labels: str) -> Sample:
    return Sample(name, {"task": "text-section", **labels}, value)


def test_the_console_reads_the_families_and_skips_what_it_cannot_use() -> None:
    got = pipeline_counts([
        _sample(QUERIES + "_total", 5, site="x", outcome="ok"),
        _sample(QUERIES + "_total", float("nan"), site="x", outcome="deadline"),
        _sample(STAGE + "_bucket", 2, stage="1", stage_task="embed", le="0.01"),
        _sample(STAGE + "_bucket", 4, stage="1", stage_task="embed", le="+Inf"),
        _sample(STAGE + "_bucket", 4, stage="1", stage_task="embed", le="soon"),
        _sample(STAGE + "_sum", 0.1, stage="1", stage_task="embed"),
        _sample(STAGE + "_count", 4, stage="1", stage_task="embed"),
        _sample("tiermesh_cascade_queries_total", 9, answered="local")])
    assert got.queries == {("text-section", "ok"): 5}
    assert got.buckets == {("text-section", "1", "embed"): {0.01: 2, math.inf: 4}}
    assert got.sums == {("text-section", "1", "embed"): 0.1}


def test_the_summary_adds_sites_buckets_and_estimates_quantiles() -> None:
    a, b = AgentMetrics("edge-a"), AgentMetrics("core")
    for m in (a, b):
        m.known(tasks=["embed", "topic"], tenants=[], variants=["v"], sites=["edge-a", "core"])
    for _ in range(9):
        a.pipeline("text-section", _answer((1, "embed", 1.5), (2, "topic", 30.0)))
    b.pipeline("text-section", _answer((1, "embed", 1.5), (2, "topic", 300.0)))
    b.pipeline("text-section", DeadlineExceeded("late"))
    b.pipeline("gone-pipeline", _answer((1, "embed", 1.0)))
    sites = {site: pipeline_counts(parse_samples(m.render().decode())) for site, m in (("edge-a", a), ("core", b))}
    out = summary({"text-section": META}, sites, {"mid": "HTTP 404"}, now=5.0)
    assert out["scrape_errors"] == {"mid": "HTTP 404"} and out["at"] == 5.0
    gone, ts = out["tasks"]  # sorted by task
    assert (ts["task"], ts["kind"], ts["declared"], ts["accuracy"]) == ("text-section", "sequence",
                                                                         ["embed", "topic"], 0.75)
    assert ts["queries"] == 11 and ts["outcomes"] == {"deadline": 1, "ok": 10}
    assert ts["sites"] == [{"site": "core", "queries": 2, "outcomes": {"deadline": 1, "ok": 1}},
                           {"site": "edge-a", "queries": 9, "outcomes": {"ok": 9}}]
    embed, topic = ts["stages"]
    assert (embed["stage"], embed["stage_task"], embed["count"]) == ("1", "embed", 10)
    # every embed answer fell in (1 ms, 2.5 ms]: p50 and p95 interpolate inside that bucket
    assert 1.0 < embed["p50_ms"] < embed["p95_ms"] <= 2.5 and math.isclose(embed["mean_ms"], 1.5)
    # topic: 9 in (20, 50] ms at edge-a, 1 in (200, 500] ms at core: p50 inside the first, p95 inside the second
    assert (topic["stage"], topic["stage_task"], topic["count"]) == ("2", "topic", 10)
    assert 20.0 < topic["p50_ms"] <= 50.0 and 200.0 < topic["p95_ms"] <= 500.0
    assert math.isclose(topic["mean_ms"], (9 * 30.0 + 300.0) / 10)
    # a pipeline no longer declared still shows what the doors counted
    assert (gone["task"], gone["kind"], gone["declared"], gone["queries"]) == ("gone-pipeline", None, [], 1)
    empty = summary({"text-section": META}, {})["tasks"][0]
    assert (empty["queries"], empty["outcomes"], empty["sites"], empty["stages"]) == (0, {}, [], [])


def _plane(door: Any) -> SiteDataPlane:
    view: Any = SimpleNamespace(pipelines={"text-section": META}, signatures={}, variants={}, topology=None)
    metrics = AgentMetrics("edge-a")
    metrics.known(tasks=["embed", "topic"], tenants=[], variants=["v"], sites=[])
    dp = SiteDataPlane("edge-a", view, SimpleNamespace(instances={}), FakeZmq({}),  # type: ignore[arg-type]
                       table=lambda: None, peer_endpoint=lambda s: None, demand=DemandMeter(), metrics=metrics)
    dp.infer = door  # type: ignore[method-assign]  # each stage query answered here, not routed
    return dp


async def test_the_door_records_an_answered_and_a_failed_pipeline_query() -> None:
    async def door(req: InferRequest) -> InferResponse:
        if req.inputs["x"][0, 0] < 0:
            raise DeadlineExceeded("too slow")
        return InferResponse(req.request_id, {"y": req.inputs["x"]}, "edge-a", "v", 0.9, "local",
                             timing=Timing(0.0, 0.0, 1.0, 1.0))

    dp = _plane(door)
    x = np.ones((2, 2), np.float32)
    resp = await dp._pipeline(InferRequest.entering("text-section", {"x": x}, SLO(1000.0, 0.0)))
    assert [st.task for st in resp.stages] == ["embed", "topic"]
    with pytest.raises(DeadlineExceeded):
        await dp._pipeline(InferRequest.entering("text-section", {"x": -x}, SLO(1000.0, 0.0)))
    assert dp.metrics.pipelines == {("text-section", "ok"): 1, ("text-section", "deadline"): 1}
    assert {k: sum(h.counts) for k, h in dp.metrics.pipeline_stages.items()} == {
        ("text-section", "1", "embed"): 1, ("text-section", "2", "topic"): 1}
