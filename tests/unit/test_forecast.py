"""Demand forecast: Holt's level + trend, the seasonal profile, per-key tracking, merging."""

from __future__ import annotations

import math

import pytest

from core_scheduler.policy.forecast import (
    DemandForecaster,
    EwmaTrend,
    Seasonal,
    forecast,
    seasonal_peak,
    seasonal_update,
    seasonal_value,
    update,
    with_forecast,
)
from core_scheduler.policy.placement import Demand

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


# -- seasonal -------------------------------------------------------------------------------

P = 30.0  # a compressed "day"


def peak_day(t: float) -> float:
    """10 qps between phases 20 and 25 s of every period, else nothing."""
    return 10.0 if 20.0 <= t % P < 25.0 else 0.0


def feed(s: Seasonal, t0: float, t1: float, rate: object, dt: float = 1.0) -> Seasonal:
    assert callable(rate)
    t = t0
    while t < t1:
        s = seasonal_update(s, rate(t), t)
        t += dt
    return s


def test_pattern_of_last_period_is_forecast_ahead_of_its_recurrence() -> None:
    s = feed(Seasonal.empty(P, 1.0), 0.0, P, peak_day)  # one period observed
    # at 16 s of the next period: the peak is 4 s away; a 5 s horizon sees it, a 3 s one does not
    peak, lead = seasonal_peak(s, P + 16.0, 5.0)
    assert peak == pytest.approx(10.0) and lead == pytest.approx(4.0)
    assert seasonal_peak(s, P + 16.0, 3.0) == (0.0, 0.0)
    assert seasonal_value(s, P + 22.5) == pytest.approx(10.0)
    assert seasonal_value(s, P + 5.0) == 0.0


def test_horizon_wraps_across_the_period_boundary() -> None:
    s = feed(Seasonal.empty(P, 1.0), 0.0, P, lambda t: 4.0 if t % P < 2.0 else 0.0)
    peak, lead = seasonal_peak(s, 2 * P - 3.0, 5.0)  # 3 s before the next period starts
    assert peak == pytest.approx(4.0) and lead == pytest.approx(3.0)


def test_unseen_phases_forecast_nothing() -> None:
    s = feed(Seasonal.empty(P, 1.0), 0.0, 10.0, lambda t: 7.0)  # only phases 0-10 s seen
    assert math.isnan(seasonal_value(s, P + 20.0))
    assert seasonal_peak(s, P + 15.0, 10.0) == (0.0, 0.0)


def test_one_off_blip_decays_while_a_recurring_peak_stays() -> None:
    blip = feed(Seasonal.empty(P, 1.0), 0.0, P, peak_day)
    recurring = blip
    values = []
    for k in range(1, 5):
        blip = feed(blip, k * P, (k + 1) * P, lambda t: 0.0)
        recurring = feed(recurring, k * P, (k + 1) * P, peak_day)
        values.append(seasonal_value(blip, (k + 1) * P + 22.0))
    assert values == sorted(values, reverse=True) and values[0] < 10.0 and values[-1] < 1.0
    assert seasonal_value(recurring, 5 * P + 22.0) == pytest.approx(10.0)


def test_bin_keeps_the_highest_rate_of_its_period() -> None:
    s = Seasonal.empty(P, 10.0)  # three bins of 10 s
    for t, q in ((1.0, 2.0), (4.0, 9.0), (8.0, 3.0)):
        s = seasonal_update(s, q, t)
    assert seasonal_value(s, P + 5.0) == 9.0
    assert s.bins == 3 and s.bin_of(P + 25.0) == 2 and s.cycle_of(P + 25.0) == 1


def seasonal_forecaster() -> DemandForecaster:
    return DemandForecaster(period_s=P, bin_s=1.0, min_qps=0.05)


def run_days(fc: DemandForecaster, days: float, rate: object, t0: float = 1000.0 * P) -> None:
    assert callable(rate)
    for k in range(int(days * P)):
        t = t0 + k
        q = rate(t)
        fc.observe([d("edge-sin", q, "peak")] if q > 0 else [], now=t)


def test_forecaster_prewarms_a_recurring_peak_but_not_the_first() -> None:
    fc = seasonal_forecaster()
    t0 = 1000.0 * P
    # before any peak was seen, nothing is forecast for the peak's key
    run_days(fc, 0.5, peak_day, t0)
    assert fc.forecast(5.0, now=t0 + 16.0) == []
    run_days(fc, 1.0, peak_day, t0 + 0.5 * P)      # the first peak (phase 20-25 s) happens
    assert fc.seasonal("edge-sin", "digits", "peak") is not None
    # the trend model alone has decayed to nothing by phase 16 of the next day ...
    quiet = t0 + 2 * P + 16.0
    run_days(fc, 16.0 / P, lambda t: 0.0, t0 + 2 * P)
    out = fc.forecast(5.0, now=quiet)
    assert [x.site for x in out] == ["edge-sin"]
    assert out[0].qps == pytest.approx(10.0) and "seasonal" in out[0].forecast_why
    assert out[0].budget_ms == 20.0 and out[0].min_accuracy == 0.95
    # ... but the horizon decides: 3 s ahead there is nothing yet
    assert fc.forecast(3.0, now=quiet) == []
    merged = fc.with_forecast([], 5.0, now=quiet)
    assert merged[0].qps == 0.0 and merged[0].effective_qps == pytest.approx(10.0)


def test_trend_only_forecaster_forgets_what_seasonal_remembers() -> None:
    trend_only = DemandForecaster()
    seasonal = seasonal_forecaster()
    for fc in (trend_only, seasonal):
        run_days(fc, 1.0, peak_day)
        run_days(fc, 0.5, lambda t: 0.0, 1000.0 * P + P)
    assert len(trend_only) == 0
    assert len(seasonal) == 1


def test_seasonal_key_is_forgotten_once_its_peak_stops_recurring() -> None:
    fc = seasonal_forecaster()
    run_days(fc, 1.0, peak_day)
    run_days(fc, 12.0, lambda t: 0.0, 1001.0 * P)  # 10 qps halves every silent day
    assert len(fc) == 0
