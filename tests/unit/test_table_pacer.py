"""The routing table's pacing for load-only view changes (issue 30, ``edge_agent.table_pacer``): a change of what
the mesh is rebuilds at once; load reports rebuild no more often than keeps rebuilding under a share of the site's
CPU, between the view's debounce and two seconds."""

from __future__ import annotations

import dataclasses

import pytest

from core_scheduler.policy.routing import Query, RoutingTable
from core_scheduler.policy.snapshot import MeshSnapshot
from edge_agent.table_pacer import (
    MAX_INTERVAL_S,
    MIN_INTERVAL_S,
    SHARE,
    TablePacer,
    bucket,
    routing_inputs,
    same_routing,
)
from mesh.errors import MeshError
from tests.unit.test_routing import ALL, snap

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("cores", "cost_s", "interval"), [
    (2.0, 0.005, MIN_INTERVAL_S),   # an uncapped site: the view's own debounce, as before pacing
    (0.1, 0.005, 0.5),              # a tenth of a core: 5 ms of rebuild at most 10 % of it
    (0.1, 0.010, 1.0),
    (0.1, 0.050, MAX_INTERVAL_S),   # never staler than two seconds
    (0.0, 0.005, MAX_INTERVAL_S),   # no CPU known: the slowest pace, not a division by zero
])
def test_the_interval_keeps_rebuilding_under_its_share(cores: float, cost_s: float, interval: float) -> None:
    p = TablePacer(cores=cores)
    p.observe(cost_s, now=100.0)
    assert p.interval_s() == pytest.approx(interval)
    if MIN_INTERVAL_S < interval < MAX_INTERVAL_S:
        assert cost_s / p.interval_s() == pytest.approx(SHARE * cores)


def test_structural_changes_rebuild_at_once_load_reports_wait_their_turn() -> None:
    p = TablePacer(cores=0.1)
    assert p.wait_s(0.0, structural=False) == 0.0  # nothing built yet: build now
    p.observe(0.010, now=10.0)                     # interval 1 s
    assert p.wait_s(10.2, structural=True) == 0.0
    assert p.wait_s(10.2, structural=False) == pytest.approx(0.8)
    assert p.wait_s(11.5, structural=False) == 0.0


def test_the_cost_is_a_moving_mean_so_one_slow_rebuild_does_not_stall_routing() -> None:
    p = TablePacer(cores=0.1)
    for _ in range(8):
        p.observe(0.005, now=0.0)
    p.observe(0.030, now=1.0)                      # one rebuild six times the usual (descheduled)
    assert p.interval_s() < MAX_INTERVAL_S
    assert p.interval_s() == pytest.approx((0.005 + 0.25 * (0.030 - 0.005)) / (SHARE * 0.1))


# -- a rebuild that would build the table in force is skipped ----------------------------------------------------
REVS = {"variant": 3, "placement": 2, "live": 40}


def _decisions(s: MeshSnapshot) -> list[tuple[str, str]]:
    table = RoutingTable.build(s, "edge-a")
    out = []
    for floor, budget in ((0.95, 200.0), (0.98, 200.0), (0.99, 200.0), (0.95, 1.5), (0.99, 20.0)):
        try:
            d = table.decide(Query(task="digits", tenant="t1", budget_ms=budget, min_accuracy=floor))
        except MeshError as exc:
            out.append(("refused", type(exc).__name__))
        else:
            out.append((d.site, d.variant_id))
    return out


def _with_load(s: MeshSnapshot, site: str, **over: object) -> MeshSnapshot:
    return dataclasses.replace(s, version=s.version + 1,
                               loads={**s.loads, site: dataclasses.replace(s.loads[site], **over)})  # type: ignore[arg-type]


def test_heartbeats_that_repeat_what_routing_reads_build_no_table() -> None:
    base = snap(ALL)
    # a later heartbeat: another count in flight (room left), a queue a few per cent longer, memory a little lower,
    # a correction within its step; the heartbeats' own revision moved
    free = base.loads["mid"].memory_free_bytes - (1 << 20)
    before = _with_load(base, "mid", queue_ms={"cnn.fp32": 2.1}, memory_free_bytes=free)
    held = routing_inputs(before, {"core": 3.0}, REVS)
    same = _with_load(before, "mid", inflight=3, queue_ms={"cnn.fp32": 2.2}, memory_free_bytes=free - (1 << 20))
    assert routing_inputs(same, {"core": 3.05}, {**REVS, "live": 41}) == held
    assert _decisions(same) == _decisions(before)
    assert 0 < bucket(2.1) == bucket(2.2) < bucket(2.6) and bucket(0.3) == bucket(float("nan")) == 0
    assert bucket(1e300) < bucket(float("inf"))  # no overflow on a queue estimate that never drains


@pytest.mark.parametrize("change", [
    "queue", "loaded", "full", "dead", "catalog", "placement", "correction",
])
def test_what_routing_reads_changing_builds_a_table(change: str) -> None:
    base = snap(ALL)
    held = routing_inputs(base, {"core": 3.0}, REVS)
    revs, corr, s = REVS, {"core": 3.0}, base
    if change == "queue":
        s = _with_load(base, "core", queue_ms={"big.fp32": 30.0})
    elif change == "loaded":
        s = _with_load(base, "edge-b", loaded=frozenset({"tiny.int8"}))
    elif change == "full":
        s = _with_load(base, "mid", inflight=base.loads["mid"].capacity)
    elif change == "dead":
        s = snap(ALL, site_over={"mid": {"alive": False}})
    elif change == "catalog":
        revs = {**REVS, "variant": 4}
    elif change == "placement":
        s = dataclasses.replace(base, placement={**base.placement, "edge-b": frozenset({"cnn.fp32"})})
    else:
        corr = {"core": 9.0}
    new = routing_inputs(s, corr, revs)
    assert new != held
    if change == "correction":  # the learned path corrections move with every sample: taken up every 2 s
        assert same_routing(held, new, age_s=0.5) and not same_routing(held, new, age_s=MAX_INTERVAL_S)
    else:
        assert not same_routing(held, new, age_s=0.0)
    assert not same_routing(None, held, age_s=0.0) and same_routing(held, held, age_s=100.0)
