"""Agent metrics (exposition parses, bounded labels, Triton names) and the trace store (bounded, per-tenant
summaries, peers' hop records coerced into the served shape)."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.metrics import AgentMetrics, Gauges
from edge_agent.traces import MAX_HOPS, HopTrace, TraceStore, clean_hops, sampled
from mesh.tracecontext import child_traceparent, new_traceparent, parse_traceparent, trace_id_of
from mesh.types import SLO, InferResponse, Timing

pytestmark = pytest.mark.unit


def _families(m: AgentMetrics) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        out[fam.name] = [(s.name, s.labels, s.value) for s in fam.samples]
    return out


def _resp(variant: str = "mlp", reason: str = "local", total: float = 5.0, acc: float = 0.97) -> InferResponse:
    return InferResponse("r", {"y": np.zeros((1, 10), np.float32)}, "edge", variant, acc, reason,
                         timing=Timing(1.0, 0.5, 2.0, total))


def test_counts_render_parse_and_collapse_unknown_labels() -> None:
    m = AgentMetrics("edge")
    m.known(tasks=["digits"], tenants=["acme"], variants=["mlp"], sites=["core"])
    m.gauges = lambda: Gauges(loaded={"mlp": (1000, 3)}, peers={"core": False}, etcd_connected=True)
    slo = SLO(20.0, 0.95)
    m.door_ok("digits", "acme", slo, _resp())
    m.door_ok("digits", "acme", slo, _resp(total=50.0))                   # late: SLO missed
    m.door_ok("nope", "mallory", slo, _resp(variant="x", reason="weird"))  # unknown labels collapse
    m.door_error("digits", "acme", "quota_exceeded", slo)
    m.door_error("digits", "acme", "deadline", slo)
    m.served_ok("digits", "acme", "mlp", "forwarded", 1.0, 2.0, 4.0, rows=3)
    m.served_failed("mlp", "overloaded")
    m.batch_ran("mlp", 3)
    m.cold_start("mlp", prewarm=True)
    m.forwarded("core")
    m.forwarded("elsewhere")
    f = _families(m)
    req = {(s[1]["task"], s[1]["tenant"], s[1]["variant"], s[1]["outcome"], s[1]["reason"]): s[2]
           for s in f["tiermesh_requests"]}
    assert req == {("digits", "acme", "mlp", "ok", "local"): 2, ("other", "other", "other", "ok", "other"): 1,
                   ("digits", "acme", "none", "quota_exceeded", "none"): 1,
                   ("digits", "acme", "none", "deadline", "none"): 1}
    assert all(s[1]["site"] == "edge" for s in f["tiermesh_requests"])
    slo_counts = {(s[1]["tenant"], s[1]["result"]): s[2] for s in f["tiermesh_slo"]}
    assert slo_counts == {("acme", "met"): 1, ("acme", "missed"): 2, ("other", "met"): 1}  # quota: not the mesh's
    lat = {s[1]["le"]: s[2] for s in f["tiermesh_request_latency_seconds"]
           if s[0].endswith("_bucket") and s[1]["task"] == "digits" and s[1]["component"] == "total"}
    assert lat["0.005"] == 1 and lat["0.05"] == 2 and lat["+Inf"] == 2
    assert f["tiermesh_quota_rejections"] == [("tiermesh_quota_rejections_total", {"tenant": "acme"}, 1)]
    assert {s[1]["destination"]: s[2] for s in f["tiermesh_forwards"]} == {"core": 1, "other": 1}
    assert f["tiermesh_prewarms"][0][2] == 1 and f["tiermesh_cold_starts"] == []
    assert f["tiermesh_peer_reachable"] == [("tiermesh_peer_reachable", {"peer": "core"}, 0.0)]
    assert f["tiermesh_etcd_connected"][0][2] == 1.0 and f["tiermesh_loaded_variants"][0][2] == 1
    assert f["tiermesh_queue_depth"][0][2] == 3 and f["tiermesh_variant_memory_bytes"][0][2] == 1000
    # Triton's names, as Triton writes them (no _total in the exposition; the parser adds it to samples)
    text = m.render().decode()
    assert 'nv_inference_request_success{model="mlp",version="1"} 1.0' in text
    assert 'nv_inference_count{model="mlp",version="1"} 3.0' in text
    assert 'nv_inference_request_failure{model="mlp",version="1",reason="overloaded"} 1.0' in text
    assert f["nv_inference_compute_infer_duration_us"][0][2] == 2000.0
    assert {s[1]["role"] for s in f["tiermesh_served"]} == {"forwarded"}


def test_each_agent_has_its_own_registry() -> None:
    a, b = AgentMetrics("a"), AgentMetrics("b")
    a.door_error("t", "public", "bad_tensor")
    assert "bad_tensor" in a.render().decode() and "bad_tensor" not in b.render().decode()


def test_trace_store_is_bounded_and_filters_by_tenant() -> None:
    store = TraceStore(3)
    for i in range(5):
        store.add(f"r{i}", "t", "acme" if i % 2 else "globex", "digits", "ok", [])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    assert [t["request_id"] for t in store.recent(10)] == ["r4", "r3", "r2"]
    assert [t["request_id"] for t in store.recent(10, "acme")] == ["r3"]
    assert [t["request_id"] for t in store.recent(1)] == ["r4"]
    with pytest.raises(ValueError):
        TraceStore(0)


def test_peer_hop_records_are_coerced_into_the_served_shape() -> None:
    hop = HopTrace("core", "serve")
    hop.serving("big", "forwarded")
    hop.timed(Timing(0.0, 1.0, 2.0, 3.5))
    good = hop.records[0]
    assert clean_hops([good]) == [good]
    junk = [{"site": 5, "role": "boss", "candidates": [1, {"site": "x", "cost": "free", "feasible": 1}],
             "choice": "me", "timings_ms": {"total": float("inf")}}, "nope"] + [good] * (MAX_HOPS + 5)
    out = clean_hops(junk)
    assert len(out) == MAX_HOPS
    assert out[0]["site"] == "" and out[0]["role"] == "serve" and out[0]["choice"] is None
    assert out[0]["candidates"] == [{"site": "x", "variant": "", "network_ms": 0.0, "queue_ms": 0.0,
                                     "compute_ms": 0.0, "load_ms": 0.0, "latency_ms": 0.0, "cost": 0.0,
                                     "feasible": False,
                                     "why_not": None}]
    assert out[0]["timings_ms"]["total"] == -1.0
    assert clean_hops("x") == [] and clean_hops(None) == []


def test_failed_attempt_is_marked_on_its_record() -> None:
    hop = HopTrace("edge", "edge")
    hop.serving("mlp", "forward")
    hop.failed("peer_down")
    hop.failed("peer_down")  # the attempt's failure, then the query's: one mark
    assert hop.records[0]["choice"]["reason"] == "forward failed: peer_down"


def test_traceparent_and_sampling() -> None:
    tp = new_traceparent()
    tid, span, flags = parse_traceparent(tp) or ("", "", "")
    assert len(tid) == 32 and len(span) == 16 and flags == "01" and trace_id_of(tp) == tid
    child = child_traceparent(tp)
    assert trace_id_of(child) == tid and child != tp
    assert new_traceparent("ab" * 16).startswith("00-" + "ab" * 16)
    for bad in ("", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", tp.upper(), "01" + tp[2:], tp + "x", 5):
        assert parse_traceparent(bad) is None
    assert not any(sampled(0.0) for _ in range(1000))
    assert all(sampled(1.0) for _ in range(100))


async def test_scheduler_metrics_and_handler() -> None:
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from core_scheduler.metrics import SchedulerMetrics, metrics_handler

    m = SchedulerMetrics()
    m.state = lambda: (True, True, 2)
    m.rounds.inc()
    m.decided("prewarm")
    m.decided("something-new")
    m.duration.observe(0.002)
    resp = await metrics_handler(m.registry)(make_mocked_request("GET", "/metrics"))
    assert isinstance(resp, web.Response) and resp.body is not None
    fams = {f.name: f for f in text_string_to_metric_families(bytes(resp.body).decode())}  # type: ignore[arg-type]
    assert fams["tiermesh_scheduler_leader"].samples[0].value == 1.0
    assert fams["tiermesh_scheduler_terms"].samples[0].value == 2
    decided = {s.labels["action"]: s.value for s in fams["tiermesh_scheduler_decisions"].samples
               if s.name.endswith("_total")}
    assert decided["prewarm"] == 1 and decided["other"] == 1 and decided["load"] == 0
    assert "tiermesh_scheduler_decision_seconds" in fams and "tiermesh_etcd_connected" in fams

    def deny(request: web.Request) -> None:
        raise web.HTTPForbidden()

    with pytest.raises(web.HTTPForbidden):
        await metrics_handler(m.registry, authorize=deny)(make_mocked_request("GET", "/metrics"))
