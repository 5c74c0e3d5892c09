"""Placement: cover each demand where it fits, replicate hot variants, evict idle ones, prewarm."""

from __future__ import annotations

import dataclasses
import random

import pytest

from core_scheduler.policy.forecast import DemandForecaster, with_forecast
from core_scheduler.policy.placement import Demand, PlacementConfig, PlacementPlan, plan_placement
from core_scheduler.policy.snapshot import MeshSnapshot, SiteInfo, SiteLoad, VariantInfo

pytestmark = pytest.mark.unit

MB = 1 << 20
NOW = 10_000.0
Over = dict[str, dict[str, object]]

LINKS = [("edge-a", "mid1", 5.0, 100.0), ("edge-a", "mid2", 6.0, 100.0), ("edge-b", "mid1", 5.0, 100.0),
         ("mid1", "core", 20.0, 1000.0), ("mid2", "core", 20.0, 1000.0)]


def variants() -> list[VariantInfo]:
    return [
        VariantInfo("digits", "tiny.int8", 0.96, MB, precision="int8",
                    compute_ms={"cpu-arm": {1: 1.0}, "cpu-x86": {1: 0.5}, "gpu": {1: 0.2}},
                    load_ms={"cpu-arm": 20.0}, memory_bytes=MB),
        VariantInfo("digits", "tiny.fp32", 0.965, 4 * MB,
                    compute_ms={"cpu-arm": {1: 1.2}, "cpu-x86": {1: 0.6}, "gpu": {1: 0.2}},
                    load_ms={"cpu-arm": 20.0}, memory_bytes=4 * MB),
        VariantInfo("digits", "cnn.fp32", 0.985, 50 * MB,
                    compute_ms={"cpu-arm": {1: 8.0}, "cpu-x86": {1: 3.0}, "gpu": {1: 1.0}},
                    load_ms={"cpu-arm": 300.0}, memory_bytes=50 * MB),
        VariantInfo("digits", "big.fp32", 0.99, 900 * MB,
                    compute_ms={"cpu-x86": {1: 20.0}, "gpu": {1: 2.0}},
                    load_ms={"gpu": 2000.0}, memory_bytes=900 * MB),
    ]


def snap(placed: dict[str, set[str]], site_over: Over | None = None,
         load_over: Over | None = None) -> MeshSnapshot:
    base = [SiteInfo("edge-a", "edge", "eu", "cpu-arm", 4, 64, 0, 0.036),
            SiteInfo("edge-b", "edge", "eu", "cpu-arm", 4, 64, 0, 0.036),
            SiteInfo("mid1", "middle", "eu", "cpu-x86", 16, 2048, 0, 1.44),
            SiteInfo("mid2", "middle", "eu", "cpu-x86", 16, 2048, 0, 1.44),
            SiteInfo("core", "core", "eu", "gpu", 64, 262144, 4, 14.4)]
    sites = [dataclasses.replace(s, **(site_over or {}).get(s.name, {})) for s in base]  # type: ignore[arg-type]
    loads = [SiteLoad(s.name, frozenset(placed.get(s.name, set())), capacity=s.slots,
                      **(load_over or {}).get(s.name, {}))  # type: ignore[arg-type]
             for s in sites if s.alive]
    return MeshSnapshot.from_parts(sites, variants(), loads, LINKS, placement=placed)


def demand(site: str = "edge-a", qps: float = 10.0, acc: float = 0.95, budget: float = 5.0,
           cls: str = "std", forecast: float = 0.0) -> Demand:
    return Demand(site, "digits", cls, qps, acc, budget, forecast_qps=forecast)


def plan(s: MeshSnapshot, ds: list[Demand], last_used: dict[tuple[str, str], float] | None = None,
         since: dict[tuple[str, str], float] | None = None, cfg: PlacementConfig | None = None,
         **kw: object) -> PlacementPlan:
    return plan_placement(s, ds, NOW, last_used or {}, since or {}, cfg or PlacementConfig(), **kw)  # type: ignore[arg-type]


def actions(p: PlacementPlan) -> set[tuple[str, str, str]]:
    return {(e.site, e.variant_id, e.action) for e in p.events}


def test_edge_gets_small_int8_variant_for_tight_latency() -> None:
    p = plan(snap({}), [demand(budget=5.0, acc=0.95)])
    assert actions(p) == {("edge-a", "tiny.int8", "load")}
    assert p.per_site["edge-a"] == ("tiny.int8",)
    assert "within 5 ms" in p.events[0].reason


def test_without_prefer_small_edge_takes_the_fastest() -> None:
    p = plan(snap({}), [demand(budget=5.0, acc=0.95)], cfg=PlacementConfig(edge_prefer_small=False))
    assert actions(p) == {("edge-a", "tiny.int8", "load")}  # also the fastest on cpu-arm
    p = plan(snap({}), [demand(budget=5.0, acc=0.962)], cfg=PlacementConfig(edge_prefer_small=False))
    assert actions(p) == {("edge-a", "tiny.fp32", "load")}


@pytest.mark.parametrize("mid_mb,where", [(2048, "mid1"), (512, "core")])
def test_high_accuracy_demand_goes_to_nearest_site_with_memory(mid_mb: int, where: str) -> None:
    s = snap({}, {"mid1": {"memory_mb": mid_mb}, "mid2": {"memory_mb": mid_mb}})
    p = plan(s, [demand(acc=0.99, budget=100.0)])
    assert actions(p) == {(where, "big.fp32", "load")}


def test_edge_memory_limit_with_headroom_sends_demand_to_middle() -> None:
    # cnn (50 MB) at the edge meets 20 ms (8 ms compute) but 60 MB x 0.8 headroom cannot hold it
    p = plan(snap({}, {"edge-a": {"memory_mb": 60}}), [demand(acc=0.98, budget=20.0)])
    assert actions(p) == {("mid1", "cnn.fp32", "load")}
    p = plan(snap({}, {"edge-a": {"memory_mb": 64}}), [demand(acc=0.98, budget=20.0)])
    assert actions(p) == {("edge-a", "cnn.fp32", "load")}


def test_already_placed_variant_is_preferred() -> None:
    s = snap({"mid1": {"cnn.fp32"}})
    p = plan(s, [demand(acc=0.98, budget=20.0)])
    assert p.events == () and p.per_site["mid1"] == ("cnn.fp32",)


# (name, loaded_since, last_used, cfg, load overrides, pinned, expected action or None)
IDLE_CASES = [
    ("idle_past_threshold", NOW - 500, NOW - 200, PlacementConfig(), {}, None, "evict"),
    ("recently_used", NOW - 500, NOW - 60, PlacementConfig(), {}, None, None),
    ("never_used_but_young", NOW - 100, None, PlacementConfig(min_residency_s=300, idle_evict_s=60),
     {}, None, "keep"),
    ("never_used_old", NOW - 400, None, PlacementConfig(min_residency_s=300, idle_evict_s=60),
     {}, None, "evict"),
    ("in_flight", NOW - 500, NOW - 200, PlacementConfig(), {"mid1": {"queue_ms": {"cnn.fp32": 2.0}}},
     None, "keep"),
    ("pinned", NOW - 500, NOW - 200, PlacementConfig(), {}, {"mid1": ["cnn.fp32"]}, None),
]


@pytest.mark.parametrize("name,since,used,cfg,load_over,pinned,expected", IDLE_CASES,
                         ids=[c[0] for c in IDLE_CASES])
def test_idle_eviction(name: str, since: float, used: float | None, cfg: PlacementConfig,
                       load_over: Over, pinned: dict[str, list[str]] | None, expected: str | None) -> None:
    pair = ("mid1", "cnn.fp32")
    p = plan(snap({"mid1": {"cnn.fp32"}}, load_over=load_over), [], {pair: used} if used else {},
             {pair: since}, cfg, pinned=pinned)
    got = [e for e in p.events if e.variant_id == "cnn.fp32"]
    if expected is None:
        assert got == [] and "cnn.fp32" in p.per_site["mid1"]
    else:
        assert [e.action for e in got] == [expected]
        assert ("cnn.fp32" in p.per_site["mid1"]) == (expected == "keep")


def test_variant_needed_by_demand_is_never_evicted() -> None:
    pair = ("mid1", "cnn.fp32")
    s = snap({"mid1": {"cnn.fp32"}}, {"edge-a": {"memory_mb": 40}})
    p = plan(s, [demand(acc=0.98, budget=20.0)], {pair: NOW - 5000}, {pair: NOW - 9000})
    assert p.events == () and p.per_site["mid1"] == ("cnn.fp32",)
    # without the demand the same pair goes
    p = plan(s, [], {pair: NOW - 5000}, {pair: NOW - 9000})
    assert actions(p) == {("mid1", "cnn.fp32", "evict")}


def test_memory_pressure_evicts_least_recently_used_first() -> None:
    # edge-a: 62 MB x 0.8 = 49.6 MB; idle cnn (50 MB, past min residency) must go for tiny to fit
    s = snap({"edge-a": {"cnn.fp32"}}, {"edge-a": {"memory_mb": 62}})
    used = {("edge-a", "cnn.fp32"): NOW - 100}
    since = {("edge-a", "cnn.fp32"): NOW - 1000}
    p = plan(s, [demand(budget=5.0)], used, since)
    assert [(e.variant_id, e.action) for e in p.events] == [("cnn.fp32", "evict"), ("tiny.int8", "load")]
    assert "make room for tiny.int8" in p.events[0].reason
    # the same variant with queries in flight stays; tiny cannot fit, nothing else meets 5 ms, and
    # the placed cnn (8 ms) is the nearest server meeting the accuracy floor: nothing changes
    s = snap({"edge-a": {"cnn.fp32"}}, {"edge-a": {"memory_mb": 62}},
             {"edge-a": {"queue_ms": {"cnn.fp32": 1.0}}})
    p = plan(s, [demand(budget=5.0)], used, since)
    assert p.events == () and p.per_site["edge-a"] == ("cnn.fp32",)


def test_unmeetable_demand_gets_a_best_effort_server() -> None:
    # edge-a holds nothing (1 MB x 0.8 < tiny); mid1 is 10 ms away: nothing meets 5 ms
    p = plan(snap({}, {"edge-a": {"memory_mb": 1}}), [demand(budget=5.0)])
    assert actions(p) == {("mid1", "tiny.int8", "load")}
    assert "best effort" in p.events[0].reason


def test_hot_variant_is_replicated() -> None:
    # 10,000 qps x 3 ms = 30 slots; mid1 plans on 0.8 x 16 = 12.8 -> 3 copies wanted; only mid2
    # also meets 20 ms (edge-a lacks memory, core is 50 ms away)
    s = snap({"mid1": {"cnn.fp32"}}, {"edge-a": {"memory_mb": 40}})
    p = plan(s, [demand(qps=10_000, acc=0.98, budget=20.0)])
    assert actions(p) == {("mid2", "cnn.fp32", "load")}
    assert "replicate" in p.events[0].reason
    cold = plan(s, [demand(qps=1_000, acc=0.98, budget=20.0)])
    assert cold.events == ()
    capped = plan(s, [demand(qps=10_000, acc=0.98, budget=20.0)],
                  cfg=PlacementConfig(max_replicas_per_variant=1))
    assert capped.events == ()


def test_forecast_rise_prewarms_replica_and_new_key() -> None:
    fc = DemandForecaster(alpha=0.5, beta=0.5)
    for k in range(6):  # 500 -> 3,000 qps over 50 s: a steady ramp
        fc.observe([demand(qps=500.0 * (k + 1), acc=0.98, budget=20.0),
                    demand(site="edge-b", qps=0.0 if k < 4 else 50.0 * (k - 3), acc=0.95, budget=5.0)],
                   now=NOW - 50 + 10 * k)
    current = [demand(qps=3000.0, acc=0.98, budget=20.0)]
    merged = with_forecast(current, fc.forecast(horizon_s=60.0))
    assert merged[0].forecast_qps > 3000.0
    s = snap({"mid1": {"cnn.fp32"}}, {"edge-a": {"memory_mb": 40}})
    assert plan(s, current).events == ()  # 9 slots now: one copy is enough
    p = plan(s, merged)
    assert ("mid2", "cnn.fp32", "prewarm") in actions(p)
    assert ("edge-b", "tiny.int8", "prewarm") in actions(p)  # only the forecast has edge-b traffic
    assert all(e.action == "prewarm" for e in p.events)


def test_plan_is_deterministic_under_input_order() -> None:
    ds = [demand(qps=10_000, acc=0.98, budget=20.0), demand(site="edge-b", budget=5.0),
          demand(acc=0.99, budget=100.0, cls="accurate"), demand(site="edge-b", acc=0.98, budget=30, cls="x")]
    s = snap({"mid1": {"cnn.fp32"}, "core": {"tiny.fp32"}}, {"edge-a": {"memory_mb": 40}})
    first = plan(s, ds, {}, {("core", "tiny.fp32"): NOW - 1000})
    for seed in range(5):
        shuffled = ds[:]
        random.Random(seed).shuffle(shuffled)
        assert plan(s, shuffled, {}, {("core", "tiny.fp32"): NOW - 1000}) == first
    assert ("core", "tiny.fp32", "evict") in actions(first)


def test_dead_site_keeps_its_placement_and_demand_moves() -> None:
    s = snap({"mid1": {"cnn.fp32"}}, {"mid1": {"alive": False}, "edge-a": {"memory_mb": 40}})
    p = plan(s, [demand(acc=0.98, budget=20.0)])
    assert actions(p) == {("mid2", "cnn.fp32", "load")}
    assert p.per_site["mid1"] == ("cnn.fp32",)


def peak_demand(qps: float, forecast: float = 0.0, why: str = "") -> Demand:
    # only the edge's cnn meets 10 ms at 0.98 (mid1 is 10 ms away; edge-a has room for 50 MB)
    return Demand("edge-a", "digits", "peak", qps, 0.98, 10.0, forecast_qps=forecast, forecast_why=why)


def test_prewarm_reason_names_the_forecast() -> None:
    why = "seasonal 6.00 qps in 4 s (last period at this phase)"
    p = plan(snap({}), [peak_demand(0.0, 6.0, why)])
    assert actions(p) == {("edge-a", "cnn.fp32", "prewarm")}
    assert why in p.events[0].reason
    # the same demand observed now is a plain load, and says nothing of a forecast
    p = plan(snap({}), [peak_demand(6.0)])
    assert actions(p) == {("edge-a", "cnn.fp32", "load")} and "forecast" not in p.events[0].reason


# between recurring peaks: (current qps, forecast qps, idle s, resident s) -> kept?
BETWEEN_PEAKS = [
    ("peak_now", 5.0, 0.0, 20.0, 60.0, True),
    ("forecast_ahead", 0.0, 5.0, 20.0, 60.0, True),
    ("quiet_and_idle", 0.0, 0.0, 20.0, 60.0, False),
    ("quiet_but_just_used", 0.0, 0.0, 1.0, 60.0, True),
    ("quiet_but_just_prewarmed", 0.0, 0.0, 20.0, 2.0, True),
]


@pytest.mark.parametrize("name,qps,fc,idle,resident,kept", BETWEEN_PEAKS, ids=[c[0] for c in BETWEEN_PEAKS])
def test_peak_variant_is_dropped_between_peaks_unless_demand_or_forecast_needs_it(
        name: str, qps: float, fc: float, idle: float, resident: float, kept: bool) -> None:
    pair = ("edge-a", "cnn.fp32")
    cfg = PlacementConfig(idle_evict_s=4.0, min_residency_s=4.0)
    ds = [peak_demand(qps, fc, "seasonal")] if qps or fc else []
    p = plan(snap({"edge-a": {"cnn.fp32"}}), ds, {pair: NOW - idle}, {pair: NOW - resident}, cfg)
    assert ("cnn.fp32" in p.per_site["edge-a"]) == kept
    assert (("edge-a", "cnn.fp32", "evict") in actions(p)) == (not kept)


def test_reactive_and_proactive_plans_over_a_recurring_peak() -> None:
    """Replay two compressed days of a peak through forecaster + planner: the proactive plan holds
    the peak's variant before the second peak starts, the reactive plan only once it is observed,
    and both drop it in the quiet hours."""
    period, t0 = 30.0, 30_000.0
    fc = DemandForecaster(period_s=period, bin_s=1.0, min_qps=0.05)
    cfg = PlacementConfig(idle_evict_s=3.0, min_residency_s=3.0)
    held: dict[str, set[str]] = {"reactive": set(), "proactive": set()}
    at_peak2: dict[str, bool] = {}
    dropped: dict[str, bool] = {"reactive": False, "proactive": False}
    since: dict[str, dict[tuple[str, str], float]] = {"reactive": {}, "proactive": {}}
    used: dict[str, dict[tuple[str, str], float]] = {"reactive": {}, "proactive": {}}
    for k in range(int(2 * period)):
        t = t0 + k
        phase = k % period
        qps = 8.0 if 20 <= phase < 25 else 0.0
        current = [peak_demand(qps)] if qps else []
        fc.observe(current, now=t)
        for mode in ("reactive", "proactive"):
            ds = fc.with_forecast(current, 5.0, now=t) if mode == "proactive" else current
            placed = {"edge-a": set(held[mode])}
            p = plan_placement(snap(placed), ds, t, used[mode], since[mode], cfg)
            now_held = set(p.per_site["edge-a"])
            for vid in now_held - held[mode]:
                since[mode][("edge-a", vid)] = t
            if qps:
                for vid in now_held:
                    used[mode][("edge-a", vid)] = t
            if k >= period and 5 <= phase < 15:
                dropped[mode] = dropped[mode] or "cnn.fp32" not in now_held
            if k == period + 18:  # 2 s before the second peak
                at_peak2[mode] = "cnn.fp32" in now_held
            held[mode] = now_held
    assert dropped == {"reactive": True, "proactive": True}
    assert at_peak2 == {"reactive": False, "proactive": True}


def _heads(owner_b: str = "public", isolated_b: bool = False) -> list[VariantInfo]:
    """Two heads on one 40 MB backbone (their memory_bytes include it, as VariantInfo.from_meta makes them)."""
    def head(vid: str, task: str, owner: str, isolated: bool) -> VariantInfo:
        return VariantInfo(task, vid, 0.97, MB, owner=owner, compute_ms={"cpu-arm": {1: 1.0}},
                           memory_bytes=41 * MB, base=None if isolated else "bb", base_bytes=40 * MB)
    return [head("head-a", "digits", "public", False), head("head-b", "parity", owner_b, isolated_b)]


def _edge_with(memory_mb: int, vs: list[VariantInfo]) -> MeshSnapshot:
    edge = SiteInfo("edge-a", "edge", "eu", "cpu-arm", 4, memory_mb, 0, 0.036)
    return MeshSnapshot.from_parts([edge], vs, [SiteLoad("edge-a", capacity=4)], [])


def test_heads_sharing_a_backbone_count_it_once() -> None:
    # 42 MB of two heads on one backbone fit in 0.8 x 60 MB; two 41 MB copies would not
    s = _edge_with(60, _heads())
    ds = [Demand("edge-a", "digits", "std", 5.0, 0.9, 50.0), Demand("edge-a", "parity", "std", 5.0, 0.9, 50.0)]
    p = plan(s, ds)
    assert set(p.per_site["edge-a"]) == {"head-a", "head-b"}


def test_a_strict_tenants_head_is_charged_a_whole_backbone() -> None:
    s = _edge_with(60, _heads(owner_b="globex", isolated_b=True))
    ds = [Demand("edge-a", "digits", "std", 5.0, 0.9, 50.0),
          Demand("edge-a", "parity", "std", 5.0, 0.9, 50.0, tenant="globex")]
    p = plan(s, ds)
    # its own backbone instance does not fit beside the shared one: not both at the edge
    assert len(p.per_site["edge-a"]) == 1


def test_variant_info_of_a_head_carries_its_backbone() -> None:
    from variant_store.meta import VariantMeta

    meta = VariantMeta("parity", "head", "head.onnx.fp32", "onnx", "fp32", "onnxruntime", "ab" * 32, 2 * MB,
                       0.97, shared_base_digest="cd" * 32, owner="globex")
    shared = VariantInfo.from_meta(meta, base_bytes=40 * MB)
    assert (shared.memory_bytes, shared.base, shared.own_bytes()) == (42 * MB, "cd" * 32, 2 * MB)
    own = VariantInfo.from_meta(meta, base_bytes=40 * MB, isolated=True)
    assert (own.memory_bytes, own.base, own.own_bytes()) == (42 * MB, None, 42 * MB)


def test_a_demand_of_many_rows_is_placed_where_its_rows_meet_the_slo() -> None:
    # cnn.fp32 at 64 rows (linear past its batch-1 profile): 8 x 64 ms on edge-a, 3 x 64 = 192 ms on mid1,
    # 1 x 64 = 64 ms on the core's GPU, 50 ms away. One row fits at the edge; 64 rows only at the core.
    one = Demand("edge-a", "digits", "loose-hi", 5.0, 0.98, 150.0)
    many = dataclasses.replace(one, slo_class="loose-hi-x64", rows=64)
    p = plan(snap({}), [one])
    assert actions(p) == {("edge-a", "cnn.fp32", "load")}
    p = plan(snap({}), [one, many])
    assert actions(p) == {("edge-a", "cnn.fp32", "load"), ("core", "cnn.fp32", "load")}
    assert any("of 64 rows" in e.reason for e in p.events if e.site == "core")
    # what is placed for the one-row class does not count as covering the 64-row one
    p = plan(snap({"mid1": {"cnn.fp32"}}), [many])
    assert ("core", "cnn.fp32", "load") in actions(p)


def test_merged_demands_keep_the_most_rows() -> None:
    a = Demand("edge-a", "digits", "loose-hi-x64", 5.0, 0.98, 150.0, rows=20)
    b = dataclasses.replace(a, rows=64)
    # 20 rows: 60 ms on mid1 + 10 ms fits; 64 rows do not (192 ms): merged, the class needs the core
    assert ("mid1", "cnn.fp32", "load") in actions(plan(snap({}, {"edge-a": {"memory_mb": 40}}), [a]))
    assert actions(plan(snap({}, {"edge-a": {"memory_mb": 40}}), [a, b])) == {("core", "cnn.fp32", "load")}
