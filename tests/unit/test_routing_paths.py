"""Routing and the harness read one set of paths: on an equal-cost tie the RTT / bandwidth tables
the agent plans with and the delay proxies the harness shapes agree, and the tables are built once
per topology, not once per heartbeat."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest

import topology.paths
from core_scheduler.policy.routing import Query, RoutingTable
from core_scheduler.state.heartbeat import Heartbeat
from core_scheduler.state.snapshot import build_snapshot
from core_scheduler.state.view import MeshView
from tiermesh.mesh_options import path_shape
from topology.paths import topology_paths
from topology.schema import Hardware, Link, Site, Topology
from variant_store.meta import LatencyStats, Profile, VariantMeta

pytestmark = pytest.mark.unit

TIERS = {"core": "core", "mid-a": "middle", "mid-b": "middle", "edge": "edge"}
# edge -> core two ways at 10 ms one-way: through mid-a (the narrow one) or mid-b (the wide one)
TIE = (Link("edge", "mid-a", 4, 20, jitter_ms=1.0), Link("mid-a", "core", 6, 20),
       Link("edge", "mid-b", 5, 400), Link("mid-b", "core", 5, 400, jitter_ms=0.5))


def _site(name: str) -> Site:
    return Site(name=name, tier=TIERS[name], region="r", lat=0.0, lon=0.0,  # type: ignore[arg-type]
                hardware=Hardware(cpu_cores=2, memory_mb=4096, price_per_hour=0.1))


def _topology(links: tuple[Link, ...] = TIE) -> Topology:
    return Topology(sites={n: _site(n) for n in TIERS}, links=links)


def _meta() -> VariantMeta:
    prof = Profile(hardware_class="cpu", load_ms=5.0, latency={1: LatencyStats(1.0, 2.0)},
                   peak_memory_bytes=1 << 20)
    return VariantMeta(task="digits", family="mlp", variant_id="mlp.fp32", format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest="ab" * 32, size_bytes=1 << 20, accuracy=0.97,
                       profiles={"cpu": prof})


def _view(topo: Topology) -> MeshView:
    view = MeshView(cast(Any, None), "edge")
    for name, site in topo.sites.items():
        view._apply(f"topology/sites/{name}", site.to_dict())
    for lk in topo.links:
        view._apply(f"topology/links/{lk.a}/{lk.b}", lk.to_dict())
    view._apply("catalog/digits/mlp.fp32", _meta().to_json())
    for name in topo.sites:
        view._apply(f"live/{name}", {"loaded": {}, "inflight": 0, "capacity": 2})
    return view


def test_routing_tables_and_wan_shaping_take_the_same_path_on_a_tie() -> None:
    topo = _topology()
    paths = topology_paths(topo)
    # the tie goes to the lowest-named predecessor: core <- mid-a <- edge, both ways
    assert paths.path("edge", "core") == ["edge", "mid-a", "core"]
    assert paths.path("core", "edge") == ["core", "mid-a", "edge"]
    snap = build_snapshot(_view(topo), here="edge")
    assert snap is not None
    for src in topo.sites:
        for dst in topo.sites:
            if src == dst:
                continue
            shape = path_shape(topo, src, dst)
            i, j = snap.site_index[src], snap.site_index[dst]
            assert 2.0 * shape.latency_ms == snap.rtt_ms[i, j], (src, dst)
            assert shape.bandwidth_mbps == snap.bandwidth_mbps[i, j], (src, dst)
            assert path_shape(topo, src, dst, jitter=False).bandwidth_mbps == shape.bandwidth_mbps
    i, j = snap.site_index["edge"], snap.site_index["core"]
    # the narrow path both ways: planning on 400 Mbit/s over a 20 Mbit/s proxy would under-cost transfers
    assert snap.bandwidth_mbps[i, j] == snap.bandwidth_mbps[j, i] == 20.0
    assert path_shape(topo, "core", "edge").bandwidth_mbps == 20.0
    # the routing margin's jitter is that of the same path (edge-mid-a's 1 ms, both ways)
    assert snap.margin_ms is not None
    np.testing.assert_allclose(snap.margin_ms[i, j], 2 * 1.0 + max(1.0, 0.1 * 20.0))


def test_heartbeats_reuse_the_path_tables_and_a_link_change_rebuilds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[int] = []
    real_build = topology.paths._build

    def counting(*args: Any) -> topology.paths.PathTables:
        builds.append(1)
        return real_build(*args)

    topology.paths._TABLES.clear()
    monkeypatch.setattr(topology.paths, "_build", counting)
    view = _view(_topology())
    first = build_snapshot(view)
    assert first is not None and len(builds) == 1
    for n in range(3):  # heartbeats: live/<site> changes, the topology does not
        view._apply("live/mid-b", {"loaded": {}, "inflight": n, "capacity": 2})
        view.revision += 1
        snap = build_snapshot(view)
        assert snap is not None and snap.version == view.revision
        assert snap.rtt_ms is first.rtt_ms and snap.bandwidth_mbps is first.bandwidth_mbps
    assert len(builds) == 1
    # an rtt correction works on a copy, never on the shared table
    corrected = build_snapshot(view, here="edge", rtt_correction={"core": 3.0})
    assert corrected is not None and corrected.rtt("edge", "core") == first.rtt("edge", "core") + 3.0
    assert first.rtt("edge", "core") == 20.0 and len(builds) == 1
    # a link changes: the tables are rebuilt, and the tie is gone (mid-b is now faster)
    faster = Link("mid-b", "core", 4, 400, jitter_ms=0.5)
    view._apply("topology/links/core/mid-b", faster.to_dict())
    rebuilt = build_snapshot(view)
    assert rebuilt is not None and len(builds) == 2
    assert rebuilt.rtt("edge", "core") == 18.0
    i, j = rebuilt.site_index["edge"], rebuilt.site_index["core"]
    assert rebuilt.bandwidth_mbps[i, j] == 400.0


def test_an_agent_counts_itself_alive_before_its_first_heartbeat_comes_back() -> None:
    view = _view(_topology())
    view._apply("live/edge", None)  # our own record has not come back through the watch yet
    local = Heartbeat(site="edge", capacity=2, model_memory_budget_bytes=1 << 30)
    snap = build_snapshot(view, here="edge", local_loads=local)
    assert snap is not None and snap.sites["edge"].alive
    assert not build_snapshot(view, here="edge").sites["edge"].alive  # type: ignore[union-attr]
    table = RoutingTable.build(snap, "edge")
    assert table.decide(Query(task="digits", budget_ms=50.0)).site == "edge"
