"""The routing table's pacing for load-only view changes (issue 30, ``edge_agent.table_pacer``): a change of what
the mesh is rebuilds at once; load reports rebuild no more often than keeps rebuilding under a share of the site's
CPU, between the view's debounce and two seconds."""

from __future__ import annotations

import pytest

from edge_agent.table_pacer import MAX_INTERVAL_S, MIN_INTERVAL_S, SHARE, TablePacer

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
