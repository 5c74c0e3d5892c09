"""The pure parts of a control plane that grows linearly: what a heartbeat publishes and when, the route
set and its key ranges, incremental snapshots (no path tables for a heartbeat), chunked txn operations,
forecast state round trips."""

from __future__ import annotations

from typing import Any, cast

import pytest

import core_scheduler.state.snapshot as snapshot_mod
from core_scheduler.policy.forecast import DemandForecaster
from core_scheduler.policy.placement import Demand
from core_scheduler.state.heartbeat import DemandSample, Heartbeat, LoadedVariant, why_publish
from core_scheduler.state.scope import Scope, live_ranges, route_set, view_ranges
from core_scheduler.state.snapshot import SnapshotBuilder, build_snapshot
from core_scheduler.state.view import MeshView
from mesh.etcd.ops import MAX_TXN_OPS, Delete, Put, chunk_ops
from mesh.etcd.watch import KeyRange
from topology.schema import Hardware, Link, Site, Topology
from variant_store.meta import LatencyStats, Profile, VariantMeta

pytestmark = pytest.mark.unit


def _hb(**kw: Any) -> Heartbeat:
    base: dict[str, Any] = {"site": "e1", "endpoint": "tcp://x:1", "capacity": 4,
                            "loaded": {"v": LoadedVariant(task="t", queue_ms=10.0)}}
    return Heartbeat(**{**base, **kw})


@pytest.mark.parametrize(("change", "reason"), [
    ({}, None),
    ({"ts": 99.0, "served": 7, "view_revision": 5}, None),                            # counters: wait
    ({"loaded": {"v": LoadedVariant(task="t", queue_ms=11.0)}}, None),                # drift within noise
    ({"loaded": {"v": LoadedVariant(task="t", queue_ms=20.0)}}, "queue"),
    ({"loaded": {}}, "loaded"),
    ({"inflight": 4}, "capacity"),
    ({"endpoint": "tcp://y:2"}, "identity"),
    ({"degraded": True}, "identity"),
    ({"settling": True}, "identity"),                                                 # `tiermesh up` waits on it
    ({"demand": (DemandSample("t", "fast", "public", 1.0, 20.0, 0.9),)}, "demand"),
])
def test_why_publish(change: dict[str, Any], reason: str | None) -> None:
    assert why_publish(_hb(), _hb(**change)) == reason
    assert why_publish(None, _hb()) == "first"


def test_demand_moves_are_news_only_past_the_threshold() -> None:
    d = DemandSample("t", "fast", "public", 10.0, 20.0, 0.9)
    last = _hb(demand=(d,))
    assert why_publish(last, _hb(demand=(DemandSample("t", "fast", "public", 11.0, 20.0, 0.9),))) is None
    assert why_publish(last, _hb(demand=(DemandSample("t", "fast", "public", 14.0, 20.0, 0.9),))) == "demand"


def test_compact_record_round_trips_and_drops_defaults() -> None:
    hb = _hb(served=3)
    doc = hb.to_json()
    assert "inflight" not in doc and "gpu" not in doc and "demand" not in doc and doc["site"] == "e1"
    assert doc["loaded"]["v"] == {"task": "t", "queue_ms": 10.0}
    assert Heartbeat.from_json(doc) == hb


def _site(name: str, tier: str) -> Site:
    return Site(name, tier, "r", 0.0, 0.0, Hardware(cpu_cores=4, memory_mb=8192))  # type: ignore[arg-type]


def _chain(n: int) -> Topology:
    """A core ``c`` and edges ``e00..`` on a line, each 1 ms further from the core."""
    sites = {"c": _site("c", "core"), **{f"e{i:02d}": _site(f"e{i:02d}", "edge") for i in range(n)}}
    links = [Link("c", "e00", 1.0, 100.0)] + [Link(f"e{i:02d}", f"e{i + 1:02d}", 1.0, 100.0) for i in range(n - 1)]
    return Topology(sites=sites, links=tuple(links))


def test_route_set_is_the_nearest_peers_plus_the_nearest_of_each_tier() -> None:
    topo = _chain(30)
    got = route_set(topo, Scope("e20", peers=4, per_tier=1))
    assert got == {"e20", "e18", "e19", "e21", "e22", "c"}  # the core is far but the only one of its tier
    assert route_set(topo, Scope("e20", peers=40)) == set(topo.sites)  # a small mesh: everything
    ranges = live_ranges(got, tuple(topo.sites))
    assert ranges == [KeyRange("live/c"), KeyRange("live/e18", "live/e22\0")]
    whole = view_ranges(topo, Scope("e20", peers=4, per_tier=1))
    assert KeyRange.key("placement/e20") in whole and KeyRange.under("live/") not in whole


def _meta(vid: str = "v1") -> VariantMeta:
    prof = Profile(hardware_class="cpu", load_ms=5.0, latency={1: LatencyStats(1.0, 2.0)}, peak_memory_bytes=1 << 20)
    return VariantMeta(task="t", family="f", variant_id=vid, format="onnx", precision="fp32", runtime="onnxruntime",
                       blob_digest="ab" * 32, size_bytes=1 << 20, accuracy=0.97, profiles={"cpu": prof})


def _view(topo: Topology) -> MeshView:
    view = MeshView(cast(Any, None), "e00")
    rev = 1
    for name, site in topo.sites.items():
        view._apply(f"topology/sites/{name}", site.to_dict(), rev)
    for lk in topo.links:
        view._apply(f"topology/links/{lk.a}/{lk.b}", lk.to_dict(), rev)
    view._apply("catalog/t/v1", _meta().to_json(), rev)
    return view


def test_a_heartbeat_rebuilds_without_path_tables_and_a_link_change_with(monkeypatch: pytest.MonkeyPatch) -> None:
    view = _view(_chain(5))
    builder = SnapshotBuilder(view, here="e00")
    calls: list[int] = []
    real = snapshot_mod.topology_paths
    monkeypatch.setattr(snapshot_mod, "topology_paths", lambda t: (calls.append(1), real(t))[1])
    first = builder.build()
    assert first is not None and calls == [1] and not first.is_alive("e03")
    view._apply("live/e03", _hb(site="e03", inflight=2).to_json(), 7)
    snap = builder.build()
    assert snap is not None and calls == [1], "a heartbeat must not look up path tables"
    assert snap.is_alive("e03") and snap.loads["e03"].inflight == 2
    assert snap.rtt_ms is first.rtt_ms  # the shared tables, not a copy
    full = build_snapshot(view, here="e00")  # the from-scratch build agrees
    assert full is not None and full.loads == snap.loads and full.sites == snap.sites
    view._apply("live/e03", None, 8)
    before = len(calls)
    assert not builder.build().is_alive("e03")  # type: ignore[union-attr]
    view._apply("topology/links/e03/e04", Link("e03", "e04", 9.0, 100.0).to_dict(), 9)
    snap = builder.build()
    assert snap is not None and len(calls) == before + 1 and snap.rtt("e03", "e04") == 18.0


def test_chunk_ops_stays_within_etcd_limits() -> None:
    ops = [Put(f"placement/s{i}", {"x": i}) for i in range(300)] + [Delete("a")]
    parts = chunk_ops(ops)
    assert [len(p) for p in parts] == [MAX_TXN_OPS, MAX_TXN_OPS, 301 - 2 * MAX_TXN_OPS]
    assert [op for p in parts for op in p] == ops
    big = [Put(f"k{i}", "x" * 1000) for i in range(10)]
    assert max(len(p) for p in chunk_ops(big, max_bytes=3000)) <= 3


def test_forecast_state_round_trips() -> None:
    a = DemandForecaster(period_s=3600.0, bin_s=60.0)
    for t in range(6):
        a.observe([Demand("e1", "t", "fast", qps=2.0 + t, min_accuracy=0.9, budget_ms=20.0)], 1000.0 + 10 * t)
    b = DemandForecaster(period_s=3600.0, bin_s=60.0)
    assert b.load_state(a.to_state()) == 1
    assert b.forecast(30.0)[0].qps == pytest.approx(a.forecast(30.0)[0].qps, rel=1e-4)
    assert b.seasonal("e1", "t", "fast") == a.seasonal("e1", "t", "fast")
    other = DemandForecaster(period_s=7200.0, bin_s=60.0)  # another period: the trend only
    other.load_state(a.to_state())
    assert other.state("e1", "t", "fast") is not None and other.seasonal("e1", "t", "fast") != \
        a.seasonal("e1", "t", "fast")
    with pytest.raises(ValueError, match="malformed"):
        b.load_state({"v": 1, "keys": [["x"]]})
    assert len(b) == 1  # left as it was


def test_forecast_state_keeps_a_demands_rows_and_reads_the_version_before_rows() -> None:
    a = DemandForecaster()
    a.observe([Demand("e1", "text", "loose-lo-x64", qps=3.0, min_accuracy=0.75, budget_ms=300.0, rows=64)], 1000.0)
    state = a.to_state()
    b = DemandForecaster()
    assert b.load_state(state) == 1
    assert [d.rows for d in b.forecast(30.0)] == [64]
    old = {**state, "v": 1, "keys": [[*row[:6], *row[7:]] for row in state["keys"]]}  # a leader before rows
    c = DemandForecaster()
    assert c.load_state(old) == 1
    assert [(d.rows, d.qps) for d in c.forecast(30.0)] == [(1, pytest.approx(b.forecast(30.0)[0].qps))]
