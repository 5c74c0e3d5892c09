"""Demand forecast: Holt's level + trend, per-key tracking, merging with current demand."""

from __future__ import annotations

import pytest

from core_scheduler.policy import Demand, DemandForecaster, EwmaTrend, forecast, update, with_forecast

pytestmark = pytest.mark.unit


def run(series: list[float], dt: float = 10.0, alpha: float = 0.5, beta: float = 0.3) -> EwmaTrend:
    s = EwmaTrend(alpha=alpha, beta=beta)
    for x in series:
        s = update(s, x, dt)
    return s


@pytest.mark.parametrize("series,horizon,check", [
    ("ramp", 30.0, lambda f, last: f > last),
    ("flat", 30.0, lambda f, last: f == pytest.approx(last, rel=1e-6)),
    ("falling", 30.0, lambda f, last: f < last),
    ("to_zero", 1000.0, lambda f, last: f == 0.0),
])
def test_shapes(series: str, horizon: float, check: object) -> None:
    data = {"ramp": [10.0 * k for k in range(1, 13)], "flat": [40.0] * 12,
            "falling": [200.0 - 15 * k for k in range(12)], "to_zero": [100.0 - 8 * k for k in range(12)]}[series]
    s = run(data)
    assert check(forecast(s, horizon), data[-1])  # type: ignore[operator]


def test_ramp_forecast_grows_with_horizon_and_tracks_slope() -> None:
    s = run([5.0 * k for k in range(40)], dt=2.0)  # 2.5 qps per second
    assert s.trend == pytest.approx(2.5, rel=0.05)
    assert forecast(s, 60.0) > forecast(s, 10.0) > forecast(s, 0.0)


def test_spike_decays_back_to_baseline() -> None:
    s = run([20.0] * 10)
    s = update(s, 200.0, 10.0)
    at_spike = forecast(s, 30.0)
    assert at_spike > 40.0
    after = []
    for _ in range(30):
        s = update(s, 20.0, 10.0)
        after.append(forecast(s, 30.0))
    assert after[2] < at_spike
    assert after[-1] == pytest.approx(20.0, rel=0.1)


def test_first_observation_sets_level_and_update_is_pure() -> None:
    s0 = EwmaTrend()
    s1 = update(s0, 7.0, 0.0)
    assert (s1.level, s1.trend, s1.n) == (7.0, 0.0, 1)
    assert s0.n == 0 and s0.level == 0.0  # the old state is untouched


def d(site: str, qps: float, cls: str = "std") -> Demand:
    return Demand(site, "digits", cls, qps, 0.95, 20.0)


def test_forecaster_tracks_keys_and_forgets_gone_traffic() -> None:
    fc = DemandForecaster(alpha=0.6, beta=0.3)
    for k in range(5):
        fc.observe([d("edge-a", 10.0 * (k + 1)), d("edge-b", 5.0)], now=100.0 + 10 * k)
    out = {x.site: x for x in fc.forecast(30.0)}
    assert out["edge-a"].qps > 50.0 and out["edge-b"].qps == pytest.approx(5.0, rel=1e-3)
    assert out["edge-a"].min_accuracy == 0.95 and out["edge-a"].budget_ms == 20.0
    # edge-b goes silent: its forecast decays and the key is eventually dropped
    for k in range(5, 60):
        fc.observe([d("edge-a", 50.0)], now=100.0 + 10 * k)
    assert fc.state("edge-b", "digits", "std") is None
    assert len(fc) == 1


def test_with_forecast_merges_and_adds_forecast_only_keys() -> None:
    merged = with_forecast([d("edge-a", 30.0)], [d("edge-a", 45.0), d("edge-b", 8.0)])
    by_site = {x.site: x for x in merged}
    assert (by_site["edge-a"].qps, by_site["edge-a"].forecast_qps) == (30.0, 45.0)
    assert (by_site["edge-b"].qps, by_site["edge-b"].forecast_qps) == (0.0, 8.0)
    assert by_site["edge-b"].effective_qps == 8.0
