"""Baseline modes: each router's choices and each placer's plan on small hand-made snapshots."""

from __future__ import annotations

import dataclasses

import pytest

from core_scheduler.policy import baselines as b
from core_scheduler.policy.modes import make_router, mode_names, placer_for
from core_scheduler.policy.placement import Demand, plan_placement
from core_scheduler.policy.routing import Query, RoutingTable
from core_scheduler.policy.snapshot import MeshSnapshot, SiteInfo, SiteLoad, VariantInfo
from mesh.errors import NoRoute

pytestmark = pytest.mark.unit

MB = 1 << 20
HW = "cpu"
# one-way ms: edge-a is 5 ms from mid, mid 20 ms from core (edge-a <-> core RTT 50 ms)
LINKS = [("edge-a", "mid", 5.0, 100.0), ("edge-b", "mid", 5.0, 100.0), ("mid", "core", 20.0, 1000.0)]


def v(vid: str, acc: float, compute: float, mem_mb: int, owner: str = "public",
      precision: str = "fp32") -> VariantInfo:
    return VariantInfo("digits", vid, acc, mem_mb * MB, owner=owner, precision=precision,
                       compute_ms={HW: {1: compute}}, load_ms={HW: 5.0}, memory_bytes=mem_mb * MB)


VARIANTS = [
    v("tiny.int8", 0.96, 1.0, 1, precision="int8"),
    v("mid.fp32", 0.98, 1.8, 20),
    v("big.fp32", 0.99, 5.0, 300),
    v("acme.head", 0.995, 1.5, 5, owner="acme"),
]


def sites(mem: dict[str, int]) -> list[SiteInfo]:
    # per slot the core is cheapest, the edges dearest (as in examples/topology.yaml)
    return [
        SiteInfo("edge-a", "edge", "eu", HW, 4, mem.get("edge-a", 2048), 0, 0.8),
        SiteInfo("edge-b", "edge", "eu", HW, 4, mem.get("edge-b", 2048), 0, 0.8),
        SiteInfo("mid", "middle", "eu", HW, 16, 32768, 0, 1.9),
        SiteInfo("core", "core", "eu", HW, 32, 131072, 0, 2.9),
    ]


def snap(loaded: dict[str, set[str]] | None = None, mem: dict[str, int] | None = None) -> MeshSnapshot:
    loaded, mem = loaded or {}, mem or {}
    loads = [SiteLoad(s.name, loaded=frozenset(loaded.get(s.name, set())), capacity=s.slots,
                      memory_free_bytes=s.memory_bytes // 2) for s in sites(mem)]
    return MeshSnapshot.from_parts(sites(mem), VARIANTS, loads, LINKS, version=3)


ALL_LOADED = {s: {x.variant_id for x in VARIANTS} for s in ("edge-a", "edge-b", "mid", "core")}


def q(budget: float, acc: float, tenant: str = "public", prefer: str = "latency") -> Query:
    return Query("digits", tenant=tenant, budget_ms=budget, min_accuracy=acc, prefer=prefer)  # type: ignore[arg-type]


def test_modes_registered() -> None:
    assert set(b.BASELINES) | {"tiermesh"} <= set(mode_names())
    for mode in b.BASELINES:
        assert placer_for(mode) is not None
        assert make_router(mode, snap(ALL_LOADED), "edge-a").decide(q(100, 0.9)).site
    assert placer_for("tiermesh") is None


def test_restrict_keeps_tables_and_kills_others() -> None:
    s = snap(ALL_LOADED)
    r = b.restrict(s, sites=["mid"], variants={"digits": ["mid.fp32"]})
    assert r.is_alive("mid") and not r.is_alive("edge-a") and not r.is_alive("core")
    assert [x.variant_id for x in r.variants["digits"]] == ["mid.fp32"]
    assert r.rtt("edge-a", "core") == s.rtt("edge-a", "core") == 50.0


def test_network_blind_zeroes_reachable_paths_only() -> None:
    s = snap(ALL_LOADED)
    blind = b.network_blind(dataclasses.replace(s))
    assert blind.rtt("edge-a", "core") == 0.0
    assert float(blind.bandwidth_mbps.min()) == float("inf")


def test_edge_only_serves_here_even_when_a_remote_site_is_cheaper() -> None:
    s = snap(ALL_LOADED)
    assert RoutingTable.build(s, "edge-a").decide(q(400, 0.98)).site != "edge-a"  # tiermesh goes inward
    d = b.edge_only_router(s, "edge-a").decide(q(400, 0.98))
    assert (d.site, d.variant_id, d.reason, d.best_effort) == ("edge-a", "mid.fp32", "local", False)


def test_edge_only_best_effort_at_the_edge_when_nothing_local_fits() -> None:
    s = snap({"edge-a": {"tiny.int8"}, "core": {"big.fp32"}})
    d = b.edge_only_router(s, "edge-a").decide(q(3.0, 0.99))  # big.fp32 takes 5 ms + load
    assert d.site == "edge-a" and d.best_effort


def test_core_only_ships_to_the_core_best_public_variant() -> None:
    s = snap(ALL_LOADED)
    d = b.core_only_router(s, "edge-a").decide(q(400, 0.9, tenant="acme"))
    # acme.head is more accurate but private: the core's best *public* variant is pinned
    assert (d.site, d.variant_id, d.reason, d.best_effort) == ("core", "big.fp32", "forward", False)
    tight = b.core_only_router(s, "edge-a").decide(q(10, 0.9))
    assert tight.site == "core" and tight.best_effort  # 50 ms away: the SLO is missed, flagged


def test_core_only_has_no_route_without_a_core() -> None:
    s = snap(ALL_LOADED)
    dead = b.restrict(s, sites=["edge-a", "edge-b", "mid"])
    with pytest.raises(NoRoute):
        b.core_only_router(dead, "edge-a").decide(q(400, 0.9))


def test_static_variant_is_the_best_within_twice_the_fastest() -> None:
    s = snap(ALL_LOADED)
    pinned, wide = b.static_variant(s, "digits", HW), b.static_variant(s, "digits", HW, factor=6.0)
    assert pinned is not None and pinned.variant_id == "mid.fp32"  # 1.8 <= 2 x 1.0; big is 5x
    assert wide is not None and wide.variant_id == "big.fp32"
    assert b.static_variant(s, "digits", "gpu") is None


def test_static_router_serves_the_pinned_variant_locally() -> None:
    s = snap(ALL_LOADED)
    ok = b.static_router(s, "edge-b").decide(q(100, 0.97))
    assert (ok.site, ok.variant_id, ok.best_effort) == ("edge-b", "mid.fp32", False)
    miss = b.static_router(s, "edge-b").decide(q(100, 0.99))
    assert (miss.site, miss.variant_id, miss.best_effort) == ("edge-b", "mid.fp32", True)


def test_infaas_ignores_the_network_and_misses_tight_slos() -> None:
    s = snap(ALL_LOADED)
    aware = RoutingTable.build(s, "edge-a").decide(q(10, 0.9))
    blind = b.infaas_router(s, "edge-a").decide(q(10, 0.9))
    assert aware.site == "edge-a" and not aware.best_effort  # only the edge is within 10 ms
    # INFaaS thinks the cheapest slot (the core, 50 ms RTT away) is feasible
    assert blind.site == "core" and not blind.best_effort
    assert blind.expected_latency_ms < 10 < s.rtt("edge-a", "core")


def test_edge_only_placer_fills_edges_small_first() -> None:
    s = snap(mem={"edge-b": 512})  # 512 MB x 0.25 x 0.8 = 102 MB of models: big.fp32 does not fit
    plan = b.edge_only_placer(s, {}, {}, [])
    assert plan["mid"] == () and plan["core"] == ()
    assert set(plan["edge-a"]) == {x.variant_id for x in VARIANTS}
    assert set(plan["edge-b"]) == {"tiny.int8", "acme.head", "mid.fp32"}


def test_core_only_and_static_placers() -> None:
    s = snap()
    assert b.core_only_placer(s, {}, {}, []) == {"core": ("big.fp32",), "edge-a": (), "edge-b": (), "mid": ()}
    assert set(b.static_placer(s, {}, {}, []).values()) == {("mid.fp32",)}


def test_infaas_placer_is_reactive_and_network_blind() -> None:
    s = snap({"core": {"big.fp32"}})
    floor: dict[str, tuple[str, ...]] = {"core": ("big.fp32",), "edge-a": ("tiny.int8",)}
    want = Demand("edge-a", "digits", "acc", qps=5.0, min_accuracy=0.98, budget_ms=12.0)
    # tiermesh (network-aware) loads mid.fp32 one short hop away, at the cheapest slot that meets
    # 12 ms (the middle, 10 ms round trip): the core's big.fp32 is 50 ms away
    aware = plan_placement(s, [want], 0.0, {}, {}, pinned=floor)
    assert "mid.fp32" in aware.per_site["mid"]
    # INFaaS believes the core's copy is 5 ms away: nothing new is placed
    plan = b.infaas_placer(s, floor, {}, [want])
    assert plan["edge-a"] == ("tiny.int8",) and plan["core"] == ("big.fp32",)
    # a forecast alone (no traffic yet) never makes INFaaS load anything
    cheap = Demand("edge-b", "digits", "x", qps=0.0, min_accuracy=0.995, budget_ms=400.0, tenant="acme",
                   forecast_qps=9.0)
    assert "acme.head" not in {x for vs in b.infaas_placer(s, floor, {}, [cheap]).values() for x in vs}
    now = dataclasses.replace(cheap, qps=3.0, forecast_qps=0.0)
    assert "acme.head" in {x for vs in b.infaas_placer(s, floor, {}, [now]).values() for x in vs}


def test_a_task_with_only_private_variants_is_pinned_for_its_tenant() -> None:
    """A tenant's own task (its heads on a shared encoder): core-only and static serve it, to that tenant."""
    text = [dataclasses.replace(v("topic.small", 0.68, 0.5, 16, owner="acme"), task="topic"),
            dataclasses.replace(v("topic.large", 0.78, 2.0, 90, owner="acme"), task="topic")]
    loads = [SiteLoad(s.name, loaded=frozenset(x.variant_id for x in text), capacity=s.slots,
                      memory_free_bytes=s.memory_bytes // 2) for s in sites({})]
    s = MeshSnapshot.from_parts(sites({}), [*VARIANTS, *text], loads, LINKS, version=3)
    best = b.best_core_variant(s, "topic")
    assert best is not None and best.variant_id == "topic.large"
    assert b.best_core_variant(s, "digits").variant_id == "big.fp32"  # type: ignore[union-attr]  # public first
    ask = Query("topic", tenant="acme", budget_ms=300, min_accuracy=0.75)
    d = b.core_only_router(s, "edge-a").decide(ask)
    assert (d.site, d.variant_id, d.best_effort) == ("core", "topic.large", False)
    pinned = b.static_variant(s, "topic", HW, factor=6.0)
    assert pinned is not None and pinned.variant_id == "topic.large"
