"""The console's builds and cascades views as pure summaries (issues 34 and 33): builds counted by state per
tenant, the tenant filter, a build without a state record shown queued, each variant's p50 per hardware class;
cascade counters read from an agent's real exposition, escalation rates from counters (never a division by zero),
broken catalog entries listed with their reason."""

from __future__ import annotations

import math

import pytest

from console.builds import MAX_BUILDS, p50_by_class
from console.builds import summary as builds_summary
from console.cascades import SiteCascades, cascade_counts, escalation_rate
from console.cascades import summary as cascades_summary
from console.digest import Sample, parse_samples
from core_scheduler.state.builds import BuildView
from edge_agent.cascade_exec import ESCALATED, LOCAL
from edge_agent.metrics import AgentMetrics
from mesh.buildspec import BuildRequest, BuildState, VariantResult
from mesh.types import InferResponse, StageInfo
from variant_store.cascade_meta import CascadeMeta
from variant_store.catalog_check import BrokenEntry

pytestmark = pytest.mark.unit


def _view(tenant: str, n: int, state: str | None, created: float = 0.0, **kw: object) -> BuildView:
    bid = f"{n:032x}"
    req = BuildRequest(build_id=bid, tenant=tenant, task=f"task{n}", family="fam", model_digest="a" * 64,
                       model_bytes=10, validation_digest="b" * 64, validation_bytes=10, rows=100, door="edge-a",
                       created=created or float(n))
    st = BuildState(build_id=bid, tenant=tenant, state=state, **kw) if state else None  # type: ignore[arg-type]
    return BuildView(req, st, 1 if st else 0)


def test_builds_counted_by_state_per_tenant_newest_first() -> None:
    views = [_view("acme", 1, None), _view("acme", 2, "running", stage="building", progress=0.4),
             _view("acme", 3, "done"), _view("acme", 4, "done"),
             _view("acme", 5, "failed", error="custom op Foo", reason="custom_op"), _view("initech", 6, "done")]
    out = builds_summary(views, ["acme", "globex"], now=5.0)
    assert out["at"] == 5.0 and [t["tenant"] for t in out["tenants"]] == ["acme", "globex", "initech"]
    acme, globex, initech = out["tenants"]
    assert acme["counts"] == {"queued": 1, "running": 1, "done": 2, "failed": 1}
    assert globex == {"tenant": "globex", "counts": {"queued": 0, "running": 0, "done": 0, "failed": 0},
                      "builds": []}
    assert initech["counts"]["done"] == 1
    assert [b["task"] for b in acme["builds"]] == ["task5", "task4", "task3", "task2", "task1"]
    by_task = {b["task"]: b for b in acme["builds"]}
    assert (by_task["task1"]["state"], by_task["task1"]["progress"], by_task["task1"]["variants"]) == \
        ("queued", 0.0, [])
    assert (by_task["task2"]["stage"], by_task["task2"]["progress"]) == ("building", 0.4)
    assert (by_task["task5"]["error"], by_task["task5"]["reason"]) == ("custom op Foo", "custom_op")


def test_tenant_filter_lists_only_that_tenant() -> None:
    views = [_view("acme", 1, "done")]
    out = builds_summary([v for v in views if v.request.tenant == "globex"], ["globex"])
    assert [t["tenant"] for t in out["tenants"]] == ["globex"] and out["tenants"][0]["builds"] == []


def test_a_done_build_shows_each_variants_measurements() -> None:
    fp32 = VariantResult("mine.onnx.fp32", "onnx", "fp32", 0.93, 4096,
                         {"cpu-small": {1: 2.5, 8: 9.0}, "cpu-large": {8: 3.0, 4: 1.5}, "gpu": {}})
    int8 = VariantResult("mine.onnx.int8", "onnx", "int8", 0.91, 1024)  # not profiled yet: no latency at all
    out = builds_summary([_view("acme", 1, "done", variants=(fp32, int8), skipped=(("tensorrt", "no GPU"),))],
                         ["acme"])
    (b,) = out["tenants"][0]["builds"]
    v32, v8 = b["variants"]
    assert (v32["variant"], v32["accuracy"], v32["size_bytes"]) == ("mine.onnx.fp32", 0.93, 4096)
    assert v32["p50_ms"] == {"cpu-large": 1.5, "cpu-small": 2.5}  # batch 1, else the smallest batch measured
    assert v32["latency_ms"]["cpu-small"] == {"1": 2.5, "8": 9.0}
    assert v8["p50_ms"] == {} and v8["latency_ms"] == {}
    assert b["skipped"] == [{"kind": "tensorrt", "reason": "no GPU"}]


def test_a_tenants_list_is_capped_but_counted_whole() -> None:
    views = [_view("acme", i + 1, "done") for i in range(MAX_BUILDS + 5)]
    (acme,) = builds_summary(views, [])["tenants"]
    assert acme["counts"]["done"] == MAX_BUILDS + 5 and len(acme["builds"]) == MAX_BUILDS
    assert acme["builds"][0]["task"] == f"task{MAX_BUILDS + 5}"


@pytest.mark.parametrize(("latency", "want"), [({}, {}), ({"a": {}}, {}), ({"a": {2: 5.0, 16: 1.0}}, {"a": 5.0}),
                                               ({"a": {1: 0.0}}, {"a": 0.0})])
def test_p50_by_class(latency: dict[str, dict[int, float]], want: dict[str, float]) -> None:
    assert p50_by_class(latency) == want


# -- cascades ------------------------------------------------------------------------------------------------------

def _agent_text() -> str:
    m = AgentMetrics("edge-a")
    m.known(tasks=["digits"], tenants=[], variants=["small", "big"], sites=["core"])
    one = StageInfo(1, "edge-a", "small", 1, 1, (0.95,))
    for reason, stages in ((LOCAL, (one,)), (LOCAL, (one,)), (LOCAL, (one,)),
                           (ESCALATED, (StageInfo(1, "edge-a", "small", 3, 1, (0.95, 0.2, 0.3)),
                                        StageInfo(2, "core", "big", 2, 2)))):
        m.cascade("digits", InferResponse("r", {}, "edge-a", "small", 0.9, reason, stages=stages))
    return m.render().decode()


def test_cascade_counts_from_an_agents_real_exposition() -> None:
    sc = cascade_counts(parse_samples(_agent_text()))
    assert sc.queries == {("digits", "local"): 3, ("digits", "escalated"): 1}
    assert sc.rows == {("digits", "1"): 4, ("digits", "2"): 2}


def test_cascade_counts_ignore_what_they_do_not_know() -> None:
    samples = [Sample("tiermesh_cascade_queries_total", {"task": "t", "answered": "sideways"}, 5.0),
               Sample("tiermesh_cascade_queries_total", {"task": "t", "answered": "local"}, math.nan),
               Sample("tiermesh_cascade_queries_total", {"task": "t", "answered": "local"}, -1.0),
               Sample("tiermesh_cascade_queries_total", {"task": "t", "answered": "escalated"}, math.inf),
               Sample("tiermesh_cascade_queries_created", {"task": "t", "answered": "local"}, 1.7e9),
               Sample("tiermesh_requests_total", {"task": "t"}, 9.0),
               Sample("tiermesh_cascade_rows_total", {}, 2.0)]
    sc = cascade_counts(samples)
    assert sc.queries == {} and sc.rows == {("", ""): 2.0}


@pytest.mark.parametrize(("local", "esc", "want"), [(0, 0, None), (3, 1, 0.25), (0, 4, 1.0), (5, 0, 0.0)])
def test_escalation_rate(local: float, esc: float, want: float | None) -> None:
    assert escalation_rate(local, esc) == want


def _cascade(task: str, cid: str, esc: float = 0.3) -> CascadeMeta:
    return CascadeMeta(task=task, cascade_id=cid, stages=("small", "big"), rule="max_softmax", thresholds=(0.8,),
                       accuracy=0.97, escalation=(esc,), target_accuracy=0.96, calibration_rows=500,
                       heldout_rows=500)


def test_cascades_joined_with_each_sites_escalation() -> None:
    sites = {"edge-b": SiteCascades({("digits", "local"): 9, ("digits", "escalated"): 1}, {("digits", "1"): 10}),
             "edge-a": SiteCascades({("digits", "local"): 3, ("digits", "escalated"): 1}),
             "mid": SiteCascades({("gone-task", "escalated"): 2}),
             "core": SiteCascades()}
    broken = [BrokenEntry("cascades/text/bad", "text", "bad", "malformed cascade: rule must be one of ...")]
    out = cascades_summary([_cascade("digits", "c2"), _cascade("digits", "c1", 0.2), _cascade("text", "t1")],
                           broken, sites, {"far": "TimeoutError: "}, now=7.0)
    assert [t["task"] for t in out["tasks"]] == ["digits", "gone-task", "text"]
    digits, gone, text = out["tasks"]
    assert [c["id"] for c in digits["cascades"]] == ["c1", "c2"]
    c1 = digits["cascades"][0]
    assert (c1["stages"], c1["rule"], c1["thresholds"], c1["escalation"], c1["accuracy"], c1["heldout_rows"]) == \
        (["small", "big"], "max_softmax", [0.8], [0.2], 0.97, 500)
    assert [s["site"] for s in digits["sites"]] == ["edge-a", "edge-b"]  # core counted nothing: not listed
    a, b = digits["sites"]
    assert (a["local"], a["escalated"], a["queries"], a["escalation_rate"]) == (3, 1, 4, 0.25)
    assert (b["escalation_rate"], b["rows"]) == (0.1, {"1": 10})
    assert digits["queries"] == 14 and digits["escalation_rate"] == pytest.approx(2 / 14)
    assert gone["cascades"] == [] and gone["escalation_rate"] == 1.0  # an entry removed since: traffic still shown
    assert text["sites"] == [] and text["queries"] == 0 and text["escalation_rate"] is None
    assert out["broken"] == [{"key": "cascades/text/bad", "task": "text", "name": "bad",
                              "reason": "malformed cascade: rule must be one of ..."}]
    assert out["scrape_errors"] == {"far": "TimeoutError: "} and out["at"] == 7.0


def test_no_cascades_no_counters() -> None:
    assert cascades_summary([], [], {}) == {"tasks": [], "broken": [], "scrape_errors": {}, "at": 0.0}
