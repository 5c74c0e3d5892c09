"""Tail allowance of forwards: path jitter tables, the margin formula, and how decide() uses it."""

from __future__ import annotations

import numpy as np
import pytest

from core_scheduler.policy.routing import Query, RoutingTable
from core_scheduler.policy.snapshot import (
    TAIL_FRAC,
    TAIL_MIN_MS,
    MeshSnapshot,
    path_jitter_ms,
    path_tables,
    tail_margin_ms,
)
from mesh.errors import Overloaded
from tests.helpers.topologies import EXAMPLE
from tests.unit.test_routing import ALL, LINKS, sites, variants
from topology.loader import load_topology_file

pytestmark = pytest.mark.unit

JITTER = {("edge-a", "mid"): 0.5, ("edge-b", "mid"): 0.8, ("mid", "core"): 1.0}


def _index() -> dict[str, int]:
    return {n: i for i, n in enumerate(sorted(s.name for s in sites()))}


def test_path_jitter_sums_links_on_the_latency_path_both_ways() -> None:
    idx = _index()
    jit = path_jitter_ms(idx, [(a, b, lat, bw, JITTER[(a, b)]) for a, b, lat, bw in LINKS])
    assert jit[idx["edge-a"], idx["core"]] == pytest.approx(2 * (0.5 + 1.0))
    assert jit[idx["edge-a"], idx["edge-b"]] == pytest.approx(2 * (0.5 + 0.8))
    assert jit[idx["core"], idx["edge-b"]] == pytest.approx(2 * (1.0 + 0.8))
    assert np.all(np.diag(jit) == 0.0)
    np.testing.assert_allclose(jit, jit.T)


def test_path_jitter_follows_the_lowest_latency_path_not_the_calmest() -> None:
    idx = {"a": 0, "b": 1, "c": 2}
    # a-b direct is fast but jittery; a-c-b is slower and calm: routing's path is the direct one
    jit = path_jitter_ms(idx, [("a", "b", 5.0, 100.0, 4.0), ("a", "c", 10.0, 100.0, 0.0), ("c", "b", 10.0, 100.0, 0.0)])
    assert jit[0, 1] == pytest.approx(8.0)


@pytest.mark.parametrize(("rtt", "jitter", "want"), [
    (50.0, 3.0, 3.0 + TAIL_FRAC * 50.0),       # long haul: a share of the round trip
    (4.0, 0.0, TAIL_MIN_MS),                    # short hop: the floor
    (10.0, 1.0, 1.0 + max(TAIL_MIN_MS, TAIL_FRAC * 10.0)),
])
def test_tail_margin_formula(rtt: float, jitter: float, want: float) -> None:
    rtt_t = np.array([[0.0, rtt], [rtt, 0.0]])
    jit_t = np.array([[0.0, jitter], [jitter, 0.0]])
    m = tail_margin_ms(rtt_t, jit_t)
    assert m[0, 1] == pytest.approx(want) and m[1, 0] == pytest.approx(want)
    assert m[0, 0] == 0.0 and m[1, 1] == 0.0  # serving where the query arrived has no path risk


def test_unreachable_pairs_get_no_margin() -> None:
    rtt = np.array([[0.0, np.inf], [np.inf, 0.0]])
    assert np.all(tail_margin_ms(rtt, np.zeros((2, 2))) == 0.0)


def _snap_with_margin() -> tuple[MeshSnapshot, np.ndarray]:
    idx = _index()
    rtt, _bw = path_tables(idx, LINKS)
    margin = tail_margin_ms(rtt, path_jitter_ms(idx, [(a, b, lat, bw, JITTER[(a, b)]) for a, b, lat, bw in LINKS]))
    return MeshSnapshot.from_parts(sites(), variants(), (), LINKS, placement=ALL, margin_ms=margin, version=1), margin


def test_a_forward_whose_slack_is_thinner_than_the_margin_is_not_planned() -> None:
    snap, margin = _snap_with_margin()
    idx = snap.site_index
    m_core = float(margin[idx["edge-a"], idx["core"]])
    assert m_core > 0
    table = RoutingTable.build(snap, "edge-a")
    plain = RoutingTable.build(MeshSnapshot.from_parts(sites(), variants(), (), LINKS, placement=ALL, version=1),
                               "edge-a")
    # big.fp32 at the core: 50 ms round trip + 2 ms compute. A 55 ms budget fits the mean only.
    q = Query("digits", budget_ms=55.0, min_accuracy=0.99)
    assert plain.decide(q).site == "core" and not plain.decide(q).best_effort
    d = table.decide(q)
    assert d.best_effort, d
    # with room for the tail, the same forward is planned and its latency includes the allowance
    d = table.decide(Query("digits", budget_ms=52.0 + m_core + 0.5, min_accuracy=0.99))
    assert (d.site, d.reason, d.best_effort) == ("core", "forward", False)
    assert d.expected_latency_ms == pytest.approx(52.0 + m_core)


def test_local_candidates_carry_no_margin() -> None:
    snap, _ = _snap_with_margin()
    d = RoutingTable.build(snap, "edge-a").decide(Query("digits", budget_ms=1.0, min_accuracy=0.95))
    assert (d.site, d.reason, d.expected_latency_ms) == ("edge-a", "local", 1.0)


def test_example_topology_transatlantic_margin_exceeds_the_regional_one() -> None:
    topo = load_topology_file(EXAMPLE)
    idx = {n: i for i, n in enumerate(sorted(topo.sites))}
    rtt, _ = path_tables(idx, [(lk.a, lk.b, lk.latency_ms, lk.bandwidth_mbps) for lk in topo.links])
    m = tail_margin_ms(rtt, path_jitter_ms(idx, [(lk.a, lk.b, lk.latency_ms, lk.bandwidth_mbps, lk.jitter_ms)
                                                          for lk in topo.links]))
    regional = m[idx["edge-fra-1"], idx["mid-eu"]]
    to_core = m[idx["edge-fra-1"], idx["core-eu"]]
    transatlantic = m[idx["edge-nyc-1"], idx["core-eu"]]
    assert 0 < regional < to_core < transatlantic


def test_cold_start_elsewhere_pays_the_blob_fetch_from_the_store_site() -> None:
    base = dict(placement={"edge-a": set(), "mid": set(), "core": set()}, version=1)
    plain = MeshSnapshot.from_parts(sites(), variants(), (), LINKS, **base)  # type: ignore[arg-type]
    at_core = MeshSnapshot.from_parts(sites(), variants(), (), LINKS, store_site="core",
                                      **base)  # type: ignore[arg-type]
    tiny = next(v for v in variants() if v.variant_id == "tiny.int8")
    # edge-a -> core: 50 ms round trip, bottleneck 100 Mbit/s
    want = 50.0 + tiny.size_bytes * 8.0 / (100.0 * 1000.0)
    assert at_core.fetch_ms("edge-a", tiny.size_bytes) == pytest.approx(want)
    assert at_core.fetch_ms("core", tiny.size_bytes) == 0.0
    assert plain.fetch_ms("edge-a", tiny.size_bytes) == 0.0

    def cold_latency(snap: MeshSnapshot) -> float:
        arr = RoutingTable.build(snap, "edge-a").candidates("digits")
        i = next(k for k in range(len(arr)) if (arr.site[k], arr.variant_id[k]) == ("edge-a", "tiny.int8"))
        assert not arr.loaded[i]
        return float(arr.base_ms[i])

    assert cold_latency(at_core) == pytest.approx(cold_latency(plain) + want)
    # a loaded variant fetches nothing
    warm = MeshSnapshot.from_parts(sites(), variants(), (), LINKS, store_site="core", placement=ALL, version=1)
    arr = RoutingTable.build(warm, "edge-a").candidates("digits")
    i = next(k for k in range(len(arr)) if (arr.site[k], arr.variant_id[k]) == ("edge-a", "tiny.int8"))
    assert arr.loaded[i] and arr.load_ms[i] == 0.0


def test_unknown_store_site_is_ignored() -> None:
    snap = MeshSnapshot.from_parts(sites(), variants(), (), LINKS, store_site="nowhere", placement=ALL, version=1)
    assert snap.store_site is None


def test_a_cold_start_fetches_from_the_nearest_site_holding_the_blob() -> None:
    """A refuse-SLO query at edge-a within 125 ms at accuracy 0.95 before any placement reached the
    edge: the tiny variant (1 MiB over a 100 Mbit/s uplink, 20 ms to load) can be loaded there in time
    only if its blob comes from mid (10 ms away), which holds it, not from the store at core (50 ms
    away). Before peers served blobs: refused. Not 422 (impossible): mid and core could meet it were they not
    left out, so 503 overloaded."""
    none = {"edge-a": set(), "edge-b": set(), "core": set()}
    tiny = next(v for v in variants() if v.variant_id == "tiny.int8")
    transfer = tiny.size_bytes * 8.0 / (100.0 * 1000.0)
    for held_at_mid, feasible in ((set(), False), ({"tiny.int8"}, True)):
        snap = MeshSnapshot.from_parts(sites(), variants(), (), LINKS, store_site="core",
                                       placement={**none, "mid": held_at_mid}, version=1)
        assert snap.fetch_ms("edge-a", tiny.size_bytes, snap.holders("tiny.int8")) == pytest.approx(
            (10.0 if feasible else 50.0) + transfer)
        table = RoutingTable.build(snap, "edge-a")
        # neither mid nor core may serve it (say they are busy): the edge must load it itself, or refuse
        q = Query("digits", "t1", 125.0, 0.95, prefer="refuse", exclude_sites=frozenset({"mid", "core"}))
        if feasible:
            d = table.decide(q)
            assert (d.site, d.variant_id, d.reason) == ("edge-a", "tiny.int8", "cold_start")
        else:
            with pytest.raises(Overloaded):
                table.decide(q)
