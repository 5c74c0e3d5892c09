import pytest

from edge_agent.demand import DemandMeter, slo_class
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
