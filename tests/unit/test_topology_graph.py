"""TopologyGraph against hand-computed paths, latencies, bottlenecks and transfer times."""

from __future__ import annotations

import math
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from mesh.errors import NoRoute
from topology.graph import TopologyGraph
from topology.loader import load_topology_file
from topology.schema import Hardware, Link, Site, Topology

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "topology.yaml"


def _site(name: str, tier: str) -> Site:
    return Site(name=name, tier=tier, region="r", lat=0.0, lon=0.0,  # type: ignore[arg-type]
                hardware=Hardware(cpu_cores=2, memory_mb=1024, price_per_hour=0.1))


def _topo(links: list[Link], extra: tuple[str, ...] = ()) -> Topology:
    tiers = {"c": "core", "m1": "middle", "m2": "middle", "e1": "edge", "e2": "edge"}
    tiers.update({n: "middle" for n in extra})
    return Topology(sites={n: _site(n, t) for n, t in tiers.items()}, links=tuple(links))


#      e1 --2ms/100-- m1 --10ms/1000-- c --10ms/1000-- m2 --3ms/50-- e2
#                      \________________25ms/10000_______/
LINKS = [
    Link("e1", "m1", 2, 100),
    Link("m1", "c", 10, 1000),
    Link("m2", "c", 10, 1000),
    Link("e2", "m2", 3, 50),
    Link("m1", "m2", 25, 10000),
]


@pytest.fixture
def g() -> TopologyGraph:
    return TopologyGraph(_topo(LINKS))


def test_shortest_path_by_latency(g: TopologyGraph) -> None:
    # via the core: 2 + 10 + 10 + 3 = 25 beats the direct middle link: 2 + 25 + 3 = 30
    assert g.path("e1", "e2") == ["e1", "m1", "c", "m2", "e2"]
    assert g.path_latency_ms("e1", "e2") == 25.0
    assert g.path("e2", "e1") == ["e2", "m2", "c", "m1", "e1"]
    assert g.path_latency_ms("e2", "e1") == 25.0
    assert g.rtt_ms("e1", "e2") == 50.0


def test_same_site(g: TopologyGraph) -> None:
    assert g.path("m1", "m1") == ["m1"]
    assert g.path_latency_ms("m1", "m1") == 0.0
    assert math.isinf(g.bottleneck_bandwidth_mbps("m1", "m1"))
    assert g.transfer_ms("m1", "m1", 10**9) == 0.0


def test_bottleneck_follows_latency_path_not_widest(g: TopologyGraph) -> None:
    # m1 -> m2: via c is 20 ms at 1000 Mbit/s; the 10000 Mbit/s direct link is slower (25 ms)
    assert g.path("m1", "m2") == ["m1", "c", "m2"]
    assert g.bottleneck_bandwidth_mbps("m1", "m2") == 1000.0
    assert g.bottleneck_bandwidth_mbps("e1", "e2") == 50.0


def test_transfer_ms(g: TopologyGraph) -> None:
    # 1 MB over the 50 Mbit/s bottleneck: 8e6 bit / 50e6 bit/s = 0.16 s
    assert g.transfer_ms("e1", "e2", 1_000_000) == pytest.approx(160.0)
    # 125 kB over 1000 Mbit/s: 1e6 bit / 1e9 bit/s = 1 ms
    assert g.transfer_ms("m1", "m2", 125_000) == pytest.approx(1.0)
    assert g.transfer_ms("m1", "m2", 0) == 0.0


def test_cheaper_direct_link_changes_path() -> None:
    links = [lk if lk.ends != ("m1", "m2") else Link("m1", "m2", 15, 10000) for lk in LINKS]
    g = TopologyGraph(_topo(links))
    assert g.path("e1", "e2") == ["e1", "m1", "m2", "e2"]
    assert g.path_latency_ms("e1", "e2") == 20.0
    assert g.bottleneck_bandwidth_mbps("m1", "m2") == 10000.0


def test_latency_table_matches_networkx(g: TopologyGraph) -> None:
    names, dist = g.latency_table()
    assert names == sorted(names) and set(names) == {"c", "m1", "m2", "e1", "e2"}
    i = {n: k for k, n in enumerate(names)}
    assert dist[i["e1"], i["e2"]] == 25.0
    assert dist[i["m1"], i["m2"]] == 20.0
    assert np.all(np.diag(dist) == 0.0)
    assert np.array_equal(dist, dist.T)
    ref = dict(nx.all_pairs_dijkstra_path_length(g.nx_graph, weight="latency_ms"))
    for a in names:
        for b in names:
            assert dist[i[a], i[b]] == pytest.approx(ref[a][b])
    dist[0, 1] = -1.0  # a copy: the cached table must not change
    assert g.latency_table()[1][0, 1] != -1.0


def test_zero_latency_link_is_an_edge_in_the_table() -> None:
    g = TopologyGraph(_topo([Link("e1", "m1", 0, 100), Link("m1", "c", 5, 100), Link("e2", "c", 1, 10),
                             Link("m2", "c", 1, 10)]))
    names, dist = g.latency_table()
    i = {n: k for k, n in enumerate(names)}
    assert dist[i["e1"], i["m1"]] == 0.0
    assert dist[i["e1"], i["e2"]] == 6.0


def test_unreachable_and_unknown_sites() -> None:
    g = TopologyGraph(_topo(LINKS, extra=("island",)))
    with pytest.raises(NoRoute, match="no path"):
        g.path_latency_ms("e1", "island")
    with pytest.raises(NoRoute, match="unknown site"):
        g.path("e1", "atlantis")
    names, dist = g.latency_table()
    assert math.isinf(dist[names.index("e1"), names.index("island")])


def test_example_topology_paths() -> None:
    g = load_topology_file(EXAMPLE).graph
    # Paris edge -> New York edge: 5 (to mid-eu) + 65 (mid-eu - mid-us) + 4 (to edge-nyc-1)
    assert g.path("edge-par-1", "edge-nyc-1") == ["edge-par-1", "mid-eu", "mid-us", "edge-nyc-1"]
    assert g.path_latency_ms("edge-par-1", "edge-nyc-1") == 74.0
    assert g.bottleneck_bandwidth_mbps("edge-par-1", "edge-nyc-1") == 500.0
    # Singapore reaches the core directly (90) rather than through mid-us (115 + 70)
    assert g.path("edge-sin-1", "core-eu") == ["edge-sin-1", "core-eu"]
