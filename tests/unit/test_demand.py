import pytest

from edge_agent.demand import DemandMeter, demand_class, rows_bucket, slo_class
from mesh.types import SLO

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("lat", "acc", "cls"), [
    (10, 0.9, "tight-lo"), (25, 0.96, "tight-mid"), (100, 0.985, "medium-hi"), (500, 0.0, "loose-lo")])
def test_slo_class(lat: float, acc: float, cls: str) -> None:
    assert slo_class(SLO(latency_ms=lat, min_accuracy=acc)) == cls


def test_rate_over_window() -> None:
    m = DemandMeter(window_s=10)
    for i in range(50):
        m.record("t", SLO(latency_ms=20), now=100 + i * 0.1)  # 50 in 5 s
    snap = m.snapshot(now=105)
    assert snap[0].qps == pytest.approx(5.0)
    assert m.snapshot(now=200) == []  # all aged out


@pytest.mark.parametrize(("rows", "bucket"), [(0, 1), (1, 1), (2, 2), (3, 4), (33, 64), (64, 64), (65, 128)])
def test_rows_round_up_to_a_power_of_two(rows: int, bucket: int) -> None:
    assert rows_bucket(rows) == bucket


def test_requests_of_many_rows_are_a_demand_of_their_own() -> None:
    slo = SLO(latency_ms=300, min_accuracy=0.75)
    assert demand_class(slo) == demand_class(slo, 1) == slo_class(slo) == "loose-lo"
    assert demand_class(slo, 64) == "loose-lo-x64"
    m = DemandMeter(window_s=10)
    for i in range(20):
        m.record("text", slo, now=100 + i * 0.1)
    for i in range(10):
        m.record("text", slo, now=100 + i * 0.1, rows=40 + i)  # 40..49 rows: one class, its largest kept
    by_class = {d.slo_class: d for d in m.snapshot(now=102)}
    assert set(by_class) == {"loose-lo", "loose-lo-x64"}
    assert (by_class["loose-lo"].rows, by_class["loose-lo"].qps) == (1, pytest.approx(2.0))
    assert (by_class["loose-lo-x64"].rows, by_class["loose-lo-x64"].qps) == (49, pytest.approx(1.0))
