"""topology.paths against hand-computed paths, latencies, bottlenecks, jitter and transfer times,
against networkx on random graphs, and its tie-breaking and caching rules."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.errors import NoRoute, TopologyError
from tests.helpers.topologies import EXAMPLE
from topology.loader import load_topology_file
from topology.paths import DENSE_MAX_SITES, LinkSpec, PathTables, _build, shortest_paths, topology_paths
from topology.schema import Hardware, Link, Site, Topology

pytestmark = pytest.mark.unit

NAMES = ("c", "m1", "m2", "e1", "e2")


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
    Link("e1", "m1", 2, 100, jitter_ms=0.5),
    Link("m1", "c", 10, 1000, jitter_ms=1.0),
    Link("m2", "c", 10, 1000, jitter_ms=1.5),
    Link("e2", "m2", 3, 50),
    Link("m1", "m2", 25, 10000, jitter_ms=9.0),
]


@pytest.fixture
def g() -> PathTables:
    return topology_paths(_topo(LINKS))


def test_shortest_path_by_latency(g: PathTables) -> None:
    # via the core: 2 + 10 + 10 + 3 = 25 beats the direct middle link: 2 + 25 + 3 = 30
    assert g.path("e1", "e2") == ["e1", "m1", "c", "m2", "e2"]
    assert g.path_latency_ms("e1", "e2") == 25.0
    assert g.path("e2", "e1") == ["e2", "m2", "c", "m1", "e1"]
    assert g.path_latency_ms("e2", "e1") == 25.0
    assert g.rtt("e1", "e2") == 50.0


def test_same_site(g: PathTables) -> None:
    assert g.path("m1", "m1") == ["m1"]
    assert g.path_latency_ms("m1", "m1") == 0.0
    assert math.isinf(g.bottleneck_bandwidth_mbps("m1", "m1"))
    assert g.path_jitter_ms("m1", "m1") == 0.0
    assert g.transfer_ms("m1", "m1", 10**9) == 0.0


def test_bottleneck_and_jitter_follow_latency_path_not_widest_or_calmest(g: PathTables) -> None:
    # m1 -> m2: via c is 20 ms at 1000 Mbit/s; the 10000 Mbit/s direct link is slower (25 ms)
    assert g.path("m1", "m2") == ["m1", "c", "m2"]
    assert g.bottleneck_bandwidth_mbps("m1", "m2") == 1000.0
    assert g.bottleneck_bandwidth_mbps("e1", "e2") == 50.0
    assert g.path_jitter_ms("m1", "m2") == pytest.approx(2.5)
    assert g.path_jitter_ms("e1", "e2") == pytest.approx(3.0)


def test_transfer_ms(g: PathTables) -> None:
    # 1 MB over the 50 Mbit/s bottleneck: 8e6 bit / 50e6 bit/s = 0.16 s
    assert g.transfer_ms("e1", "e2", 1_000_000) == pytest.approx(160.0)
    # 125 kB over 1000 Mbit/s: 1e6 bit / 1e9 bit/s = 1 ms
    assert g.transfer_ms("m1", "m2", 125_000) == pytest.approx(1.0)
    assert g.transfer_ms("m1", "m2", 0) == 0.0


def test_cheaper_direct_link_changes_path() -> None:
    links = [lk if lk.ends != ("m1", "m2") else Link("m1", "m2", 15, 10000) for lk in LINKS]
    g = topology_paths(_topo(links))
    assert g.path("e1", "e2") == ["e1", "m1", "m2", "e2"]
    assert g.path_latency_ms("e1", "e2") == 20.0
    assert g.bottleneck_bandwidth_mbps("m1", "m2") == 10000.0


def test_tables_are_sorted_symmetric_and_read_only(g: PathTables) -> None:
    assert g.sites == tuple(sorted(NAMES))
    i = g.index
    assert g.latency_ms[i["e1"], i["e2"]] == 25.0 and g.rtt_ms[i["e1"], i["e2"]] == 50.0
    for table in (g.latency_ms, g.bandwidth_mbps, g.jitter_ms):
        assert np.array_equal(table, table.T)
    assert np.all(np.diag(g.latency_ms) == 0.0) and np.all(np.isinf(np.diag(g.bandwidth_mbps)))
    with pytest.raises(ValueError, match="read-only"):
        g.rtt_ms[0, 1] = -1.0


def test_zero_latency_link_is_an_edge_and_costs_nothing() -> None:
    g = topology_paths(_topo([Link("e1", "m1", 0, 100), Link("m1", "c", 5, 100), Link("e2", "c", 1, 10),
                              Link("m2", "c", 1, 10)]))
    assert g.path_latency_ms("e1", "m1") == 0.0
    assert g.path_latency_ms("e1", "e2") == 6.0
    assert g.path("e1", "e2") == ["e1", "m1", "c", "e2"]


def test_unreachable_and_unknown_sites() -> None:
    g = topology_paths(_topo(LINKS, extra=("island",)))
    with pytest.raises(NoRoute, match="no path"):
        g.path_latency_ms("e1", "island")
    with pytest.raises(NoRoute, match="unknown site"):
        g.path("e1", "atlantis")
    i, j = g.index["e1"], g.index["island"]
    assert math.isinf(g.latency_ms[i, j]) and g.bandwidth_mbps[i, j] == 0.0 and g.jitter_ms[i, j] == 0.0
    assert g.path("island", "island") == ["island"]


def test_link_to_unknown_site_is_a_topology_error() -> None:
    with pytest.raises(TopologyError, match="unknown site"):
        shortest_paths(["a", "b"], [("a", "zz", 1.0, 1.0, 0.0)])


def test_parallel_links_keep_the_faster_then_the_wider() -> None:
    g = shortest_paths("ab", [("a", "b", 5.0, 10.0, 0.0), ("b", "a", 3.0, 1.0, 0.0), ("a", "b", 3.0, 7.0, 0.0)])
    assert g.path_latency_ms("a", "b") == 3.0 and g.bottleneck_bandwidth_mbps("a", "b") == 7.0


# a -> d two ways at 10 ms: via b (100 Mbit/s) and via c (10 Mbit/s); d -> a likewise
TIE: list[LinkSpec] = [("a", "c", 5.0, 10.0, 2.0), ("c", "d", 5.0, 10.0, 2.0),
                       ("a", "b", 5.0, 100.0, 0.0), ("b", "d", 5.0, 100.0, 0.0)]


def test_ties_go_to_the_lowest_named_predecessor_the_same_both_ways() -> None:
    g = shortest_paths("abcd", TIE)
    assert g.path("a", "d") == ["a", "b", "d"]
    assert g.path("d", "a") == ["d", "b", "a"]
    assert g.bottleneck_bandwidth_mbps("a", "d") == g.bottleneck_bandwidth_mbps("d", "a") == 100.0
    assert g.path_jitter_ms("a", "d") == g.path_jitter_ms("d", "a") == 0.0
    # whatever order the links and sites come in
    for perm in itertools.permutations(TIE):
        h = shortest_paths("dcba", perm)
        assert h.path("d", "a") == ["d", "b", "a"]
        assert np.array_equal(h.bandwidth_mbps, g.bandwidth_mbps)


def test_tables_are_cached_by_content() -> None:
    a = shortest_paths("abcd", TIE)
    assert shortest_paths("dcba", [(b, a, *rest) for a, b, *rest in reversed(TIE)]) is a
    assert topology_paths(_topo(LINKS)) is topology_paths(_topo(list(reversed(LINKS))))
    changed = [Link("e1", "m1", 2, 100, jitter_ms=0.6), *LINKS[1:]]
    assert topology_paths(_topo(changed)) is not topology_paths(_topo(LINKS))


def test_no_sites() -> None:
    g = shortest_paths([], [])
    assert g.sites == () and g.rtt_ms.shape == (0, 0)


def test_example_topology_paths() -> None:
    g = topology_paths(load_topology_file(EXAMPLE))
    # Paris edge -> New York edge: 5 (to mid-eu) + 65 (mid-eu - mid-us) + 4 (to edge-nyc-1)
    assert g.path("edge-par-1", "edge-nyc-1") == ["edge-par-1", "mid-eu", "mid-us", "edge-nyc-1"]
    assert g.path_latency_ms("edge-par-1", "edge-nyc-1") == 74.0
    assert g.bottleneck_bandwidth_mbps("edge-par-1", "edge-nyc-1") == 500.0
    # Singapore reaches the core directly (90) rather than through mid-us (115 + 70)
    assert g.path("edge-sin-1", "core-eu") == ["edge-sin-1", "core-eu"]


@st.composite
def _graphs(draw: st.DrawFn) -> tuple[list[str], list[LinkSpec]]:
    n = draw(st.integers(1, 8))
    names = [f"s{i}" for i in range(n)]
    pairs = list(itertools.combinations(names, 2))
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs))) if pairs else []
    # small integer latencies make ties common
    links = [(a, b, float(draw(st.integers(0, 4))), float(draw(st.integers(1, 5))), float(draw(st.integers(0, 3))))
             for a, b in chosen]
    return names, links


@settings(max_examples=200, deadline=None)
@given(_graphs())
def test_agrees_with_networkx_and_with_its_own_paths(graph: tuple[list[str], list[LinkSpec]]) -> None:
    names, links = graph
    g = shortest_paths(names, links)
    ref = nx.Graph()
    ref.add_nodes_from(names)
    ref.add_weighted_edges_from((a, b, lat) for a, b, lat, _, _ in links)
    dist = dict(nx.all_pairs_dijkstra_path_length(ref))
    spec = {frozenset((a, b)): (lat, bw, jit) for a, b, lat, bw, jit in links}
    for a, b in itertools.product(names, repeat=2):
        if b not in dist[a]:
            assert math.isinf(g.latency_ms[g.index[a], g.index[b]])
            continue
        assert g.path_latency_ms(a, b) == pytest.approx(dist[a][b])
        path = g.path(a, b)
        assert path[0] == a and path[-1] == b and path == g.path(b, a)[::-1]
        hops = [spec[frozenset(h)] for h in itertools.pairwise(path)]
        assert sum(h[0] for h in hops) == pytest.approx(dist[a][b])
        assert g.bottleneck_bandwidth_mbps(a, b) == min((h[1] for h in hops), default=math.inf)
        assert g.path_jitter_ms(a, b) == pytest.approx(sum(h[2] for h in hops))


@settings(max_examples=150, deadline=None)
@given(_graphs())
def test_dense_and_scipy_builds_agree(graph: tuple[list[str], list[LinkSpec]]) -> None:
    """Small meshes take numpy's Floyd–Warshall, large ones scipy's Dijkstra: the same tables either way,
    tie-broken paths included (the predecessors follow from the distances, so equal distances suffice)."""
    names, links = graph
    key_sites = tuple(sorted(set(names)))
    canon = tuple(sorted((min(a, b), max(a, b), lat, bw, jit) for a, b, lat, bw, jit in links))
    dense, sparse = _build(key_sites, canon, dense=True), _build(key_sites, canon, dense=False)
    for field in ("latency_ms", "bandwidth_mbps", "jitter_ms"):
        np.testing.assert_allclose(getattr(dense, field), getattr(sparse, field), rtol=1e-12)
    assert np.array_equal(dense.pred, sparse.pred)


def test_a_mesh_of_ordinary_size_never_imports_scipy() -> None:
    """The agent builds path tables on every topology change; at up to DENSE_MAX_SITES sites that must not load
    scipy (tens of MB resident per agent). Checked in a fresh interpreter."""
    code = ("import sys; from topology.paths import shortest_paths; "
            "n = 40; sites = [f's{i}' for i in range(n)]; "
            "g = shortest_paths(sites, [(sites[i], sites[i + 1], 1.0 + i % 3, 100.0, 0.1) for i in range(n - 1)]); "
            "assert g.path_latency_ms('s0', 's39') > 0; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('scipy', 'networkx')))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, check=True).stdout
    assert out.strip() == "[]"
    assert DENSE_MAX_SITES >= 40
