"""Routing cost model: each latency term, each filter, tie-breaking, best effort, refusal."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core_scheduler.policy.routing import Query, RoutingTable
from core_scheduler.policy.snapshot import MeshSnapshot, SiteInfo, SiteLoad, VariantInfo
from mesh.errors import DeadlineExceeded, ImpossibleSLO, NoRoute, Overloaded, UnknownTask

pytestmark = pytest.mark.unit

MB = 1 << 20

# one-way link latency; the snapshot's table is round trip (2x)
LINKS = [("edge-a", "mid", 5.0, 100.0), ("edge-b", "mid", 5.0, 100.0), ("mid", "core", 20.0, 1000.0)]


def sites(**over: dict[str, object]) -> list[SiteInfo]:
    base = {
        "edge-a": SiteInfo("edge-a", "edge", "eu", "cpu-arm", 4, 2048, 0, 0.036),
        "edge-b": SiteInfo("edge-b", "edge", "eu", "cpu-arm", 4, 2048, 0, 0.036),
        "mid": SiteInfo("mid", "middle", "eu", "cpu-x86", 16, 32768, 0, 1.44),
        "core": SiteInfo("core", "core", "eu", "gpu", 64, 262144, 4, 14.4),
    }
    return [dataclasses.replace(s, **over.get(n, {})) for n, s in base.items()]  # type: ignore[arg-type]


def variants() -> list[VariantInfo]:
    return [
        VariantInfo("digits", "tiny.int8", 0.96, MB, precision="int8",
                    compute_ms={"cpu-arm": {1: 1.0, 8: 4.0}, "cpu-x86": {1: 0.5}, "gpu": {1: 0.2}},
                    load_ms={"cpu-arm": 20.0, "cpu-x86": 10.0, "gpu": 10.0}, memory_bytes=MB, max_batch=8),
        VariantInfo("digits", "cnn.fp32", 0.985, 50 * MB,
                    compute_ms={"cpu-arm": {1: 8.0}, "cpu-x86": {1: 3.0}, "gpu": {1: 1.0}},
                    load_ms={"cpu-arm": 300.0, "cpu-x86": 200.0, "gpu": 200.0}, memory_bytes=50 * MB),
        VariantInfo("digits", "big.fp32", 0.99, 900 * MB,
                    compute_ms={"cpu-x86": {1: 20.0}, "gpu": {1: 2.0, 8: 9.0}},
                    load_ms={"cpu-x86": 2000.0, "gpu": 2000.0}, memory_bytes=900 * MB, max_batch=8),
        VariantInfo("digits", "acme.head", 0.995, 10 * MB, owner="acme",
                    compute_ms={"gpu": {1: 1.5}}, load_ms={"gpu": 100.0}, memory_bytes=10 * MB),
    ]


def snap(loaded: dict[str, set[str]], site_over: dict[str, dict[str, object]] | None = None,
         load_over: dict[str, dict[str, object]] | None = None) -> MeshSnapshot:
    ss = sites(**(site_over or {}))
    loads = []
    for s in ss:
        if not s.alive:
            continue
        kw: dict[str, object] = {"loaded": frozenset(loaded.get(s.name, set())), "capacity": s.slots,
                                 "memory_free_bytes": s.memory_bytes // 2}
        kw.update((load_over or {}).get(s.name, {}))
        loads.append(SiteLoad(s.name, **kw))  # type: ignore[arg-type]
    return MeshSnapshot.from_parts(ss, variants(), loads, LINKS, version=7)


ALL = {"edge-a": {"tiny.int8"}, "mid": {"cnn.fp32", "tiny.int8"}, "core": {"big.fp32", "acme.head"}}


def test_path_tables_are_round_trip_with_bottleneck() -> None:
    s = snap(ALL)
    assert s.rtt("edge-a", "mid") == pytest.approx(10.0)
    assert s.rtt("edge-a", "core") == pytest.approx(50.0)
    assert s.rtt("edge-b", "edge-a") == pytest.approx(20.0)
    i, j = s.site_index["edge-a"], s.site_index["core"]
    assert s.bandwidth_mbps[i, j] == 100.0  # edge-a—mid is the bottleneck
    assert np.isinf(s.bandwidth_mbps[i, i])


# (name, loaded, query kwargs, site/load overrides, expected site, variant, latency, reason)
TERM_CASES = [
    ("compute_local", ALL, {"min_accuracy": 0.95}, {}, "edge-a", "tiny.int8", 1.0, "local"),
    ("rtt_forward", ALL, {"min_accuracy": 0.98}, {}, "mid", "cnn.fp32", 10.0 + 3.0, "forward"),
    ("rtt_core", ALL, {"min_accuracy": 0.99}, {}, "core", "big.fp32", 50.0 + 2.0, "forward"),
    # 125 kB over the 100 Mbit/s bottleneck = 10 ms
    ("transfer", ALL, {"min_accuracy": 0.99, "nbytes": 125_000}, {}, "core", "big.fp32", 62.0, "forward"),
    # queue 3 ms: joins a batch of 1 + 3 // 2 = 2 -> gpu compute interpolated 2 + 7/7 = 3 ms
    ("queue_and_batch", ALL, {"min_accuracy": 0.99},
     {"load": {"core": {"queue_ms": {"big.fp32": 3.0}}}}, "core", "big.fp32", 50.0 + 3.0 + 3.0, "forward"),
    # cold big at mid (x86: 20 ms, load 2 s) is far cheaper than cold big on the gpu core
    ("cold_start", {"edge-a": {"tiny.int8"}}, {"min_accuracy": 0.99, "budget_ms": 5000.0}, {},
     "mid", "big.fp32", 10.0 + 20.0 + 2000.0, "cold_start"),
]


@pytest.mark.parametrize("name,loaded,qkw,over,site,variant,latency,reason", TERM_CASES,
                         ids=[c[0] for c in TERM_CASES])
def test_latency_terms(name: str, loaded: dict[str, set[str]], qkw: dict[str, object],
                       over: dict[str, dict[str, dict[str, object]]], site: str, variant: str,
                       latency: float, reason: str) -> None:
    table = RoutingTable.build(snap(loaded, over.get("site"), over.get("load")), "edge-a")
    q = Query(**{"task": "digits", "tenant": "t1", "budget_ms": 200.0, **qkw})  # type: ignore[arg-type]
    d = table.decide(q)
    assert (d.site, d.variant_id, d.reason) == (site, variant, reason)
    assert d.expected_latency_ms == pytest.approx(latency, abs=1e-6)
    assert not d.best_effort and d.feasible_count >= 1


def test_cost_is_slot_seconds_times_price() -> None:
    table = RoutingTable.build(snap(ALL), "edge-a")
    d = table.decide(Query("digits", "t1", 200.0, 0.99))
    # big on the gpu core: 2 ms of one of 4 GPUs at 14.4 $/h
    assert d.cost == pytest.approx(2.0 / 1000 * 14.4 / 3600 / 4)


def test_cheapest_feasible_wins_over_faster() -> None:
    cheap_edge = RoutingTable.build(snap(ALL), "edge-a").decide(Query("digits", "t1", 200.0, 0.95))
    assert cheap_edge.site == "edge-a"
    dear = snap(ALL, {"edge-a": {"price_per_hour": 100.0}})
    d = RoutingTable.build(dear, "edge-a").decide(Query("digits", "t1", 200.0, 0.95))
    assert (d.site, d.variant_id, d.reason) == ("mid", "tiny.int8", "forward")
    assert d.expected_latency_ms > cheap_edge.expected_latency_ms
    assert d.feasible_count > 1


MIDBIG = {**ALL, "mid": {"cnn.fp32", "tiny.int8", "big.fp32"}}
Over = dict[str, dict[str, object]]
# (name, query kwargs, site overrides, load overrides, (site, variant) chosen, (site, variant)
#  chosen for the same query without the restriction)
FILTER_CASES: list[tuple[str, dict[str, object], Over, Over, tuple[str, str], tuple[str, str]]] = [
    ("accuracy", {"min_accuracy": 0.985}, {}, {}, ("mid", "cnn.fp32"), ("edge-a", "tiny.int8")),
    ("capacity", {"min_accuracy": 0.95}, {}, {"edge-a": {"inflight": 4}}, ("mid", "tiny.int8"),
     ("edge-a", "tiny.int8")),
    ("degraded", {"min_accuracy": 0.95}, {}, {"edge-a": {"degraded": True}}, ("mid", "tiny.int8"),
     ("edge-a", "tiny.int8")),
    ("dead_site", {"min_accuracy": 0.99}, {"mid": {"alive": False}}, {}, ("core", "big.fp32"),
     ("mid", "big.fp32")),
    ("excluded", {"min_accuracy": 0.95, "exclude_sites": frozenset({"edge-a"})}, {}, {},
     ("mid", "tiny.int8"), ("edge-a", "tiny.int8")),
    ("tenant_own", {"min_accuracy": 0.992, "tenant": "acme"}, {}, {}, ("core", "acme.head"),
     ("core", "acme.head")),
]


@pytest.mark.parametrize("name,qkw,site_over,load_over,chosen,relaxed", FILTER_CASES,
                         ids=[c[0] for c in FILTER_CASES])
def test_filters(name: str, qkw: dict[str, object], site_over: Over, load_over: Over,
                 chosen: tuple[str, str], relaxed: tuple[str, str]) -> None:
    q = Query(**{"task": "digits", "tenant": "t1", "budget_ms": 200.0, **qkw})  # type: ignore[arg-type]
    d = RoutingTable.build(snap(MIDBIG, site_over, load_over), "edge-a").decide(q)
    assert (d.site, d.variant_id, d.best_effort) == (*chosen, False)
    loose = dataclasses.replace(q, exclude_sites=frozenset(),
                                min_accuracy=0.95 if name == "accuracy" else q.min_accuracy)
    d0 = RoutingTable.build(snap(MIDBIG), "edge-a").decide(loose)
    assert (d0.site, d0.variant_id) == relaxed


def test_tenant_cannot_use_another_tenants_variant() -> None:
    table = RoutingTable.build(snap(MIDBIG), "edge-a")
    d = table.decide(Query("digits", "t1", 200.0, 0.992))  # only acme.head reaches 0.992
    assert d.best_effort and d.variant_id != "acme.head"
    d = table.decide(Query("digits", "t1", 200.0, 0.992, prefer="accuracy"))
    assert d.variant_id == "big.fp32"


def test_max_cost_ceiling() -> None:
    table = RoutingTable.build(snap(MIDBIG), "edge-a")
    best = table.decide(Query("digits", "t1", 200.0, 0.985))
    capped_at_best = table.decide(Query("digits", "t1", 200.0, 0.985, max_cost=best.cost))
    assert dataclasses.replace(capped_at_best, feasible_count=best.feasible_count) == best
    assert capped_at_best.feasible_count < best.feasible_count  # dearer ones no longer count
    over = table.decide(Query("digits", "t1", 200.0, 0.985, max_cost=best.cost * 0.5))
    assert over.best_effort and over.feasible_count == 0
    # the cheapest fast candidate is too slow for the budget: the ceiling must not admit dearer ones
    slow = table.decide(Query("digits", "t1", 40.0, 0.99, max_cost=5.1e-7))
    assert (slow.site, slow.variant_id, slow.best_effort) == ("mid", "big.fp32", False)
    capped = table.decide(Query("digits", "t1", 40.0, 0.99, max_cost=4.9e-7))
    assert capped.best_effort


def test_budget_filter_turns_to_best_effort() -> None:
    table = RoutingTable.build(snap(ALL), "edge-a")
    d = table.decide(Query("digits", "t1", 12.0, 0.98))  # cnn at mid is 13 ms
    assert d.best_effort and d.reason == "best_effort_latency" and d.feasible_count == 0
    assert (d.site, d.variant_id) == ("mid", "cnn.fp32")  # lowest latency that meets accuracy


def two_mids(bw1: float) -> MeshSnapshot:
    ss = [SiteInfo("edge-a", "edge", "eu", "cpu-arm", 4, 2048, 0, 0.36),
          SiteInfo("mid1", "middle", "eu", "cpu-x86", 16, 32768, 0, 1.44),
          SiteInfo("mid2", "middle", "eu", "cpu-x86", 16, 32768, 0, 1.44)]
    links = [("edge-a", "mid1", 4.0, bw1), ("edge-a", "mid2", 6.0, 1000.0)]
    loads = [SiteLoad(n, frozenset({"cnn.fp32"}), capacity=16, memory_free_bytes=1 << 30)
             for n in ("mid1", "mid2")] + [SiteLoad("edge-a", capacity=4)]
    return MeshSnapshot.from_parts(ss, variants(), loads, links)


@pytest.mark.parametrize("bw1,nbytes,winner", [(1000.0, 0, "mid1"), (1000.0, 100_000, "mid1"),
                                               (10.0, 0, "mid1"), (10.0, 100_000, "mid2")])
def test_equal_cost_ties_break_by_latency_including_transfer(bw1: float, nbytes: int, winner: str) -> None:
    table = RoutingTable.build(two_mids(bw1), "edge-a")
    d = table.decide(Query("digits", "t1", 500.0, 0.98, nbytes=nbytes))
    assert d.site == winner and d.variant_id == "cnn.fp32"
    # same query with an exclusion of the other site takes the slower path through the run
    other = "mid2" if winner == "mid1" else "mid1"
    d2 = table.decide(Query("digits", "t1", 500.0, 0.98, nbytes=nbytes, exclude_sites=frozenset({other})))
    assert d2.site == winner


@pytest.mark.parametrize("prefer,budget,site,variant,reason", [
    ("latency", 0.5, "edge-a", "tiny.int8", "best_effort_latency"),
    # nothing arrives within 0.5 ms: the most accurate variant loaded here
    ("accuracy", 0.5, "edge-a", "tiny.int8", "best_effort_accuracy"),
    # the most accurate variant reachable within the budget: the cnn at mid (13 ms), not the big
    # one at core (~50 ms away), which would only come back 504
    ("accuracy", 30.0, "mid", "cnn.fp32", "best_effort_accuracy"),
    ("accuracy", 200.0, "core", "big.fp32", "best_effort_accuracy"),
])
def test_best_effort_modes(prefer: str, budget: float, site: str, variant: str, reason: str) -> None:
    table = RoutingTable.build(snap(ALL), "edge-a")
    d = table.decide(Query("digits", "t1", budget, 0.999, prefer=prefer))  # type: ignore[arg-type]
    assert (d.site, d.variant_id, d.reason, d.best_effort) == (site, variant, reason, True)
    assert prefer == "latency" or budget < 1.0 or d.expected_latency_ms <= budget


def test_best_effort_accuracy_without_anything_loaded_here_takes_the_fastest() -> None:
    table = RoutingTable.build(snap({"mid": {"cnn.fp32"}, "core": {"big.fp32"}}), "edge-a")
    d = table.decide(Query("digits", "t1", 0.5, 0.999, prefer="accuracy"))
    assert (d.site, d.variant_id, d.best_effort) == ("mid", "cnn.fp32", True)


def test_best_effort_latency_prefers_meeting_accuracy() -> None:
    table = RoutingTable.build(snap(ALL), "edge-a")
    d = table.decide(Query("digits", "t1", 1.0, 0.98))
    assert (d.variant_id, d.reason) == ("cnn.fp32", "best_effort_latency")


def test_refuse_names_best_latency_and_accuracy() -> None:
    table = RoutingTable.build(snap(ALL), "edge-a")
    with pytest.raises(ImpossibleSLO) as err:
        table.decide(Query("digits", "t1", 0.5, 0.999, prefer="refuse"))
    assert "best latency 1.0 ms" in err.value.message and "best accuracy 0.990" in err.value.message
    assert err.value.details["best_accuracy"] == pytest.approx(0.99)
    # a feasible query is not refused
    assert table.decide(Query("digits", "t1", 50.0, 0.9, prefer="refuse")).reason == "local"


def test_unknown_task_and_invisible_task() -> None:
    table = RoutingTable.build(snap(ALL), "edge-a")
    with pytest.raises(UnknownTask):
        table.decide(Query("nope", "t1", 50.0))
    with pytest.raises(UnknownTask):
        table.candidates("nope")
    private = MeshSnapshot.from_parts(sites(), [variants()[3]], links=LINKS)
    with pytest.raises(UnknownTask):
        RoutingTable.build(private, "edge-a").decide(Query("digits", "t1", 50.0))


def test_no_route_when_every_site_is_dead_or_excluded() -> None:
    dead: Over = {n: {"alive": False} for n in ("mid", "core", "edge-b")}
    table = RoutingTable.build(snap(ALL, dead), "edge-a")
    with pytest.raises(NoRoute):
        table.decide(Query("digits", "t1", 50.0, exclude_sites=frozenset({"edge-a"})))


def test_unprofiled_hardware_and_memory_are_hard_limits() -> None:
    s = snap({"edge-a": set()}, load_over={"edge-a": {"memory_free_bytes": 10 * MB}})
    arr = RoutingTable.build(s, "edge-a").candidates("digits")
    ok = {(si, v) for si, v, h in zip(arr.site, arr.variant_id, arr.hard_ok, strict=True) if h}
    assert ("edge-a", "big.fp32") not in ok        # no cpu-arm profile
    assert ("edge-a", "cnn.fp32") not in ok        # 50 MB does not fit in 10 MB free
    assert ("edge-a", "tiny.int8") in ok
    assert list(arr.cost) == sorted(arr.cost)      # candidates are kept in cost order


@pytest.mark.parametrize(("fp32_ms", "int8_ms", "winner"), [
    (0.018, 0.022, "m.int8"),   # 4 µs apart: below the profiles' resolution, the smaller variant wins
    (0.010, 0.300, "m.fp32"),   # really faster: cheaper, wins whatever its size
])
def test_compute_differences_below_resolution_tie_to_the_smaller_variant(
        fp32_ms: float, int8_ms: float, winner: str) -> None:
    site = SiteInfo("e", "edge", "eu", "cpu", 2, 4096, 0, 0.5)
    vs = [VariantInfo("t", "m.fp32", 0.97, 10_000, compute_ms={"cpu": {1: fp32_ms}}, load_ms={"cpu": 5.0},
                      memory_bytes=10_000),
          VariantInfo("t", "m.int8", 0.97, 4_000, precision="int8", compute_ms={"cpu": {1: int8_ms}},
                      load_ms={"cpu": 5.0}, memory_bytes=4_000)]
    load = SiteLoad("e", loaded=frozenset({"m.fp32", "m.int8"}), capacity=8, memory_free_bytes=1 << 30)
    table = RoutingTable.build(MeshSnapshot.from_parts([site], vs, [load]), "e")
    assert table.decide(Query("t", budget_ms=10)).variant_id == winner


def _reference(table: RoutingTable, q: Query) -> tuple[object, ...]:
    """decide() written plainly from the module docstring over full-length masks: no caches,
    no prefix tricks. ``decide()`` must agree with it exactly, floats and counts included."""
    a = table.candidates(q.task)
    access = np.array([o in ("public", q.tenant) for o in a.owner], dtype=bool)
    if not access.any():
        raise UnknownTask("invisible")
    lat = a.latency_ms(q.nbytes)
    hard = a.hard_ok & access & np.array([s not in q.exclude_sites for s in a.site], dtype=bool)
    cheap = np.ones(len(a), dtype=bool) if q.max_cost is None else a.cost <= q.max_cost
    feas = hard & a.capacity_ok & (a.accuracy >= q.min_accuracy) & (lat <= min(q.budget_ms, 1e300)) & cheap
    if feas.any():
        i = int(np.flatnonzero(feas)[0])
        if q.nbytes:  # the transfer term may reorder an equal-cost run (costs within 1e-9)
            end = i + 1
            while end < len(a) and np.isfinite(a.cost[end]) and np.isclose(
                    a.cost[end], a.cost[end - 1], rtol=1e-9, atol=0.0):
                end += 1
            i += int(np.where(feas[i:end], lat[i:end], np.inf).argmin())
        reason = "cold_start" if not a.loaded[i] else ("local" if a.site[i] == table.here else "forward")
        return (a.site[i], a.variant_id[i], reason, float(lat[i]), float(a.cost[i]), float(a.accuracy[i]),
                False, int(feas.sum()))
    if not hard.any():
        raise NoRoute("none")
    pool = hard & a.capacity_ok if (hard & a.capacity_ok).any() else hard
    if q.prefer == "refuse":
        # impossible only on the whole budget asked, against each candidate's floor (no queue, warm)
        full = min(max(q.budget_ms if q.slo_ms is None else q.slo_ms, q.budget_ms), 1e300)
        floor = a.floor_ms + a.per_byte_ms * float(q.nbytes)
        warm_cheap = np.ones(len(a), dtype=bool) if q.max_cost is None else a.floor_cost <= q.max_cost
        accurate = a.accuracy >= q.min_accuracy
        if not (access & np.isfinite(floor) & accurate & (floor <= full) & warm_cheap).any():
            raise ImpossibleSLO("refused")
        if (pool & a.capacity_ok & accurate & (lat <= full) & cheap).any():
            raise DeadlineExceeded("late")
        raise Overloaded("not now")
    if q.prefer == "accuracy":
        within = pool & (lat <= min(q.budget_ms, 1e300))
        if not within.any():
            within = pool & a.loaded & np.array([s == table.here for s in a.site], dtype=bool)
        if within.any():
            choose = within & (a.accuracy >= a.accuracy[within].max())
        else:
            choose = pool  # the fastest of all
        reason = "best_effort_accuracy"
    else:
        meets = pool & (a.accuracy >= q.min_accuracy)
        choose, reason = (meets if meets.any() else pool), "best_effort_latency"
    i = int(np.where(choose, lat, np.inf).argmin())
    return (a.site[i], a.variant_id[i], reason, float(lat[i]), float(a.cost[i]), float(a.accuracy[i]), True, 0)


def random_mesh(rng: np.random.Generator, n_sites: int) -> MeshSnapshot:
    """Sites in a few identical price classes (equal-cost runs), random links, loads and queues."""
    classes = [("edge", "cpu-arm", 4, 0, 0.036), ("middle", "cpu-x86", 16, 0, 1.44), ("core", "gpu", 64, 4, 14.4)]
    ss = []
    for k in range(n_sites):
        tier, hw, cores, gpus, price = classes[int(rng.integers(0, 3))]
        ss.append(SiteInfo(f"s{k}", tier, "eu", hw, cores, 32768, gpus, price, alive=bool(rng.random() > 0.1)))
    links = [(f"s{k}", f"s{j}", float(rng.uniform(1, 30)), float(rng.choice([10.0, 100.0, 1000.0])))
             for k in range(n_sites) for j in range(k + 1, n_sites) if rng.random() < 0.6]
    vids = [v.variant_id for v in variants()]
    loads = [SiteLoad(s.name, frozenset(v for v in vids if rng.random() < 0.5),
                      {v: float(rng.exponential(2.0)) for v in vids if rng.random() < 0.5},
                      int(rng.integers(0, 6)), s.slots, int(rng.integers(0, 2000)) * MB,
                      degraded=bool(rng.random() < 0.1)) for s in ss if s.alive]
    return MeshSnapshot.from_parts(ss, variants(), loads, links)


def _outcome(fn: object, *args: object) -> tuple[object, ...]:
    try:
        d = fn(*args)  # type: ignore[operator]
    except (UnknownTask, NoRoute, ImpossibleSLO, DeadlineExceeded, Overloaded) as exc:
        return ("raised", type(exc).__name__)
    if isinstance(d, tuple):
        return d
    return (d.site, d.variant_id, d.reason, d.expected_latency_ms, d.cost, d.accuracy, d.best_effort,
            d.feasible_count)


@pytest.mark.parametrize("seed", range(4))
def test_decide_matches_plain_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    mesh = random_mesh(rng, 6 + 2 * seed)
    names = list(mesh.site_index)
    table = RoutingTable.build(mesh, names[0])
    costs = [float(c) for c in table.candidates("digits").cost if np.isfinite(c)]
    paths: set[tuple[object, ...]] = set()
    for _ in range(300):  # repeated (tenant, floor, size) keys exercise the caches as well
        excl = frozenset(str(s) for s in rng.choice(names, size=int(rng.choice([0, 0, 0, 1, 2])), replace=False))
        q = Query("digits", str(rng.choice(["t1", "acme"])),
                  float(rng.choice([0.5, 5.0, 15.0, 40.0, 200.0, 5000.0, np.inf])),
                  float(rng.choice([0.0, 0.97, 0.985, 0.99, 0.999])),
                  None if rng.random() < 0.7 or not costs else float(rng.choice(costs)),
                  str(rng.choice(["latency", "latency", "accuracy", "refuse"])),  # type: ignore[arg-type]
                  int(rng.choice([0, 0, 1000, 125_000, int(rng.integers(1, 10**6))])), excl)
        if rng.random() < 0.3:  # a query that lost part of its budget before routing
            q = dataclasses.replace(q, slo_ms=q.budget_ms + float(rng.choice([1.0, 20.0, 500.0])))
        got, want = _outcome(table.decide, q), _outcome(_reference, table, q)
        assert got == want, q
        paths.add(got[2:3] if got[0] != "raised" else got)
    assert len(paths) >= 3  # several reasons / outcomes were reached, not one path 300 times


def _batch_snap() -> MeshSnapshot:
    """One model at an edge CPU (steep in batch size) and a GPU core (flat), both loaded."""
    ss = [SiteInfo("edge", "edge", "eu", "cpu-arm", 4, 2048, 0, 0.036),
          SiteInfo("core", "core", "eu", "gpu", 64, 262144, 4, 14.4)]
    v = VariantInfo("digits", "cnn", 0.985, MB, compute_ms={"cpu-arm": {1: 1.0, 8: 8.0, 64: 64.0},
                                                            "gpu": {1: 0.5, 64: 0.6}},
                    load_ms={"cpu-arm": 10.0, "gpu": 10.0}, memory_bytes=MB, max_batch=64)
    loads = [SiteLoad(s.name, loaded=frozenset({"cnn"}), capacity=s.slots, memory_free_bytes=s.memory_bytes)
             for s in ss]
    return MeshSnapshot.from_parts(ss, [v], loads, [("edge", "core", 10.0, 1000.0)], version=1)


@pytest.mark.parametrize("path", ["fast", "restricted", "best_effort", "best_effort_full"])
def test_a_request_of_many_rows_is_costed_at_its_batch(path: str) -> None:
    """One row: the edge (1 ms here, cheaper). Sixty-four rows: the edge needs 64 ms, the GPU core
    20 ms of round trip + 0.6 ms, so within a 40 ms budget the core serves them."""
    t = RoutingTable.build(_batch_snap(), "edge")
    kw: dict[str, object] = {"task": "digits", "budget_ms": 40.0}
    if path == "restricted":
        kw["max_cost"] = 1.0
    one = t.decide(Query(**kw))  # type: ignore[arg-type]
    assert (one.site, one.reason, one.expected_latency_ms) == ("edge", "local", pytest.approx(1.0))
    if path.startswith("best_effort"):  # nothing fits: the lowest latency of what there is
        kw["budget_ms"] = 5.0
        if path == "best_effort_full":  # any exclusion takes the uncached best-effort path
            kw["exclude_sites"] = frozenset({"elsewhere"})
    many = t.decide(Query(rows=64, **kw))  # type: ignore[arg-type]
    assert many.site == "core" and many.expected_latency_ms == pytest.approx(20.6)
    assert many.best_effort == path.startswith("best_effort")
    # between the profiled sizes the compute is interpolated: 8 rows at the edge, 8 ms
    assert t.decide(Query(task="digits", budget_ms=40.0, rows=8)).expected_latency_ms == pytest.approx(8.0)


def test_rows_from_the_slo_constructor() -> None:
    from mesh.types import SLO

    q = Query.from_slo("digits", "acme", SLO.parse(50.0, 0.9, None, "latency"), 40.0, 3136, rows=4)
    assert (q.rows, q.nbytes, q.budget_ms) == (4, 3136, 40.0)


def test_a_request_of_many_rows_is_billed_its_rows() -> None:
    """An edge CPU at 10 ms a row and a GPU core flat in batch size, both within a 1 s budget: one row is
    cheaper at the edge (10 ms of a cheap core against 0.5 ms of a dear GPU), sixty-four rows at the core
    (640 ms of the core against 0.6 ms of the GPU): the request's own rows are billed, not one row's."""
    ss = [SiteInfo("edge", "edge", "eu", "cpu-arm", 4, 2048, 0, 0.036),
          SiteInfo("core", "core", "eu", "gpu", 64, 262144, 4, 14.4)]
    v = VariantInfo("digits", "cnn", 0.985, MB, compute_ms={"cpu-arm": {1: 10.0, 64: 640.0}, "gpu": {1: 0.5, 64: 0.6}},
                    load_ms={"cpu-arm": 10.0, "gpu": 10.0}, memory_bytes=MB, max_batch=64)
    loads = [SiteLoad(s.name, loaded=frozenset({"cnn"}), capacity=s.slots, memory_free_bytes=s.memory_bytes)
             for s in ss]
    t = RoutingTable.build(MeshSnapshot.from_parts(ss, [v], loads, [("edge", "core", 10.0, 1000.0)], version=1),
                           "edge")
    one = t.decide(Query(task="digits", budget_ms=1000.0))
    many = t.decide(Query(task="digits", budget_ms=1000.0, rows=64))
    assert (one.site, many.site) == ("edge", "core")
    assert many.feasible_count == 2 and not many.best_effort
    assert many.cost == pytest.approx(0.6e-3 * 14.4 / 3600 / 4)
    # a cost ceiling is read against what the request costs: below the core's price of 64 rows, nothing fits
    capped = t.decide(Query(task="digits", budget_ms=1000.0, rows=64, max_cost=1e-7))
    assert capped.best_effort
