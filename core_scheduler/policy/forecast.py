"""Demand forecast for proactive placement: Holt's linear smoothing (level + trend) per key, and a
seasonal profile for traffic that recurs every period (a diurnal peak).

A rising ramp is forecast above its last value, and a peak seen at some phase of the previous
period(s) is forecast ahead of its recurrence, so placement can load ("prewarm") a variant before
the traffic arrives instead of paying the cold start on its first queries.

:class:`EwmaTrend` and :class:`Seasonal` are immutable states; :func:`update`, :func:`forecast`,
:func:`seasonal_update` and :func:`seasonal_peak` are pure. ``dt``, horizons and times are seconds;
the trend is in qps per second so irregular observation intervals stay meaningful.

Seasonal: the period is cut into bins of ``bin_s`` seconds (bin = phase of ``t`` in the period).
Within one period a bin keeps the highest rate observed in it (prewarming is about the peak, not
the mean); across periods it is smoothed, ``value = gamma x this period + (1 - gamma) x before``,
so a peak that recurs stays forecast and a one-off blip halves (gamma 0.5) with every period
that does not repeat it.

:class:`DemandForecaster` keeps both per (site, task, slo_class, tenant) and turns them into
:class:`~core_scheduler.policy.placement.Demand` values; it reads no clock (``now`` is an argument).
The forecast of a key is ``max(Holt at t + h, seasonal peak over phases (t, t + h])``, and zero
below ``min_qps`` so residual values never pin a variant.

:meth:`DemandForecaster.to_state` / :meth:`~DemandForecaster.load_state` turn what it remembers into
plain JSON and back (values to 6 significant digits, only the seasonal bins ever observed), so the
scheduler can keep it in etcd and a new leader continues the forecast instead of starting cold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from core_scheduler.policy.placement import Demand

__all__ = [
    "STATE_VERSION",
    "DemandForecaster",
    "EwmaTrend",
    "Seasonal",
    "forecast",
    "seasonal_peak",
    "seasonal_update",
    "seasonal_value",
    "update",
    "with_forecast",
]

Key = tuple[str, str, str, str]  # site, task, slo_class, tenant
STATE_VERSION = 2  # 2: a key's row carries its requests' rows after the accuracy floor (1 had none: rows 1)


def _g(x: float) -> float | None:
    """6 significant digits (JSON has no nan: None)."""
    return None if math.isnan(x) else float(f"{x:.6g}")


@dataclass(frozen=True, slots=True)
class EwmaTrend:
    level: float = 0.0
    trend: float = 0.0       # qps per second
    alpha: float = 0.5       # weight of a new observation in the level
    beta: float = 0.3        # weight of a new slope in the trend
    n: int = 0               # observations seen


def update(state: EwmaTrend, observation: float, dt: float) -> EwmaTrend:
    """Fold one observation taken ``dt`` seconds after the previous one into ``state``."""
    if state.n == 0:
        return replace(state, level=float(observation), trend=0.0, n=1)
    dt = max(float(dt), 1e-6)
    predicted = state.level + state.trend * dt
    level = state.alpha * observation + (1.0 - state.alpha) * predicted
    trend = state.beta * (level - state.level) / dt + (1.0 - state.beta) * state.trend
    return replace(state, level=level, trend=trend, n=state.n + 1)


def forecast(state: EwmaTrend, horizon_s: float) -> float:
    """Expected qps ``horizon_s`` seconds ahead (never negative)."""
    return max(0.0, state.level + state.trend * max(0.0, horizon_s))


@dataclass(frozen=True, slots=True)
class Seasonal:
    """Per phase bin: the smoothed rate of earlier periods (``prior``, nan = none), the highest
    rate seen in the period the bin was last observed in (``current``) and that period's index."""

    period_s: float
    bin_s: float
    prior: tuple[float, ...]
    current: tuple[float, ...]
    cycle: tuple[int, ...]       # -1: never observed
    gamma: float = 0.5

    @classmethod
    def empty(cls, period_s: float, bin_s: float, gamma: float = 0.5) -> Seasonal:
        if period_s <= 0 or bin_s <= 0:
            raise ValueError("seasonal period and bin must be positive")
        n = max(1, round(period_s / bin_s))
        return cls(period_s, period_s / n, (math.nan,) * n, (0.0,) * n, (-1,) * n, gamma)

    @property
    def bins(self) -> int:
        return len(self.prior)

    def bin_of(self, t: float) -> int:
        return int((t % self.period_s) // self.bin_s) % self.bins

    def cycle_of(self, t: float) -> int:
        return int(t // self.period_s)


def _blend(s: Seasonal, i: int) -> float:
    """The bin's value over every period observed so far (nan when never observed)."""
    if s.cycle[i] < 0:
        return s.prior[i]
    if math.isnan(s.prior[i]):
        return s.current[i]
    return s.gamma * s.current[i] + (1.0 - s.gamma) * s.prior[i]


def seasonal_update(s: Seasonal, observation: float, t: float) -> Seasonal:
    """Fold the rate observed at time ``t`` into the bin of its phase."""
    i, c = s.bin_of(t), s.cycle_of(t)
    prior, current, cycle = list(s.prior), list(s.current), list(s.cycle)
    obs = max(0.0, float(observation))
    if cycle[i] == c:
        current[i] = max(current[i], obs)
    else:
        # a new period reached this bin: what was current becomes history
        prior[i] = _blend(s, i)
        current[i], cycle[i] = obs, c
    return replace(s, prior=tuple(prior), current=tuple(current), cycle=tuple(cycle))


def seasonal_value(s: Seasonal, t: float) -> float:
    """The rate this phase had in earlier periods, or nan when it has never been observed."""
    return _blend(s, s.bin_of(t))


def seasonal_peak(s: Seasonal, t: float, horizon_s: float) -> tuple[float, float]:
    """The highest rate recorded for the phases of ``[t, t + horizon_s]``, and how many seconds
    after ``t`` its bin starts (0 when it is the bin of ``t``); ``(0.0, 0.0)`` when none is known."""
    best, best_at = 0.0, 0.0
    first = s.bin_of(t)
    into = (t % s.period_s) - first * s.bin_s  # seconds already spent in the bin of t
    for k in range(s.bins):
        at = 0.0 if k == 0 else k * s.bin_s - into
        if at > horizon_s:
            break
        v = _blend(s, (first + k) % s.bins)
        if not math.isnan(v) and v > best:
            best, best_at = v, at
    return best, best_at


@dataclass(frozen=True, slots=True)
class _Tracked:
    state: EwmaTrend
    template: Demand            # latest SLO parameters seen for the key
    at: float                   # time of the last observation
    seasonal: Seasonal | None


class DemandForecaster:
    """Holt (and, given ``period_s``, a seasonal profile) per demand key, fed with the full demand
    list each round. Keys whose traffic is gone are forgotten once neither model remembers them."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3, forget_below_qps: float = 0.01, *,
                 period_s: float | None = None, bin_s: float = 1.0, gamma: float = 0.5,
                 min_qps: float = 0.0) -> None:
        self._proto = EwmaTrend(alpha=alpha, beta=beta)
        self._forget = forget_below_qps
        self._season = Seasonal.empty(period_s, bin_s, gamma) if period_s else None
        self._min_qps = min_qps
        self._tracked: dict[Key, _Tracked] = {}
        self._now: float | None = None

    def __len__(self) -> int:
        return len(self._tracked)

    @property
    def period_s(self) -> float | None:
        return self._season.period_s if self._season is not None else None

    def observe(self, demands: Iterable[Demand], now: float) -> None:
        """Record one round of observed demand; a known key missing from it observed 0 qps."""
        self._now = now
        seen: dict[Key, Demand] = {}
        for d in demands:
            key = (d.site, d.task, d.slo_class, d.tenant)
            prev = seen.get(key)
            seen[key] = d if prev is None else replace(d, qps=prev.qps + d.qps)
        for key in sorted(set(seen) | set(self._tracked)):
            old = self._tracked.get(key)
            cur = seen.get(key)
            template = cur if cur is not None else (old.template if old is not None else None)
            if template is None:
                continue
            qps = cur.qps if cur is not None else 0.0
            state = old.state if old is not None else self._proto
            dt = now - old.at if old is not None else 0.0
            new = update(state, qps, dt)
            season = old.seasonal if old is not None else self._season
            if season is not None:
                season = seasonal_update(season, qps, now)
            if cur is None and self._forgettable(new, season):
                self._tracked.pop(key, None)  # traffic gone and not recurring: bound the memory
                continue
            self._tracked[key] = _Tracked(new, template, now, season)

    def _forgettable(self, state: EwmaTrend, season: Seasonal | None) -> bool:
        if state.level >= self._forget or forecast(state, 0.0) >= self._forget:
            return False
        if season is None:
            return True
        return all(math.isnan(v) or v < self._forget
                   for v in (_blend(season, i) for i in range(season.bins)))

    def to_state(self) -> dict[str, Any]:
        """Everything it remembers, as compact JSON (see the module docstring)."""
        keys = []
        for key in sorted(self._tracked):
            t = self._tracked[key]
            row: list[Any] = [*key, _g(t.template.budget_ms), _g(t.template.min_accuracy), t.template.rows,
                              _g(t.state.level), _g(t.state.trend), t.state.n, round(t.at, 3)]
            if t.seasonal is not None:
                seen = [i for i in range(t.seasonal.bins)
                        if t.seasonal.cycle[i] >= 0 or not math.isnan(t.seasonal.prior[i])]
                row.append([[i, _g(t.seasonal.prior[i]), _g(t.seasonal.current[i]), t.seasonal.cycle[i]]
                            for i in seen])
            keys.append(row)
        season = self._season
        return {"v": STATE_VERSION, "period_s": season.period_s if season else None,
                "bin_s": season.bin_s if season else None, "now": self._now, "keys": keys}

    def load_state(self, state: Mapping[str, Any]) -> int:
        """Replace what it remembers with ``state`` (from :meth:`to_state`); returns the keys taken.
        Seasonal profiles of another period or bin width are dropped (the trend is kept). A malformed
        state raises ``ValueError`` and leaves this forecaster as it was."""
        try:
            version = int(state["v"])
            if version not in (1, STATE_VERSION):
                raise ValueError(f"forecast state version {state['v']!r}, expected {STATE_VERSION}")
            season = self._season
            same = season is not None and state.get("period_s") == season.period_s and \
                state.get("bin_s") == season.bin_s
            tracked: dict[Key, _Tracked] = {}
            for row in state["keys"]:
                if version == 1:  # no rows: every request one row
                    row = [*row[:6], 1, *row[6:]]
                site, task, slo_class, tenant = (str(x) for x in row[:4])
                budget, floor, rows, level, trend, n, at = row[4:11]
                if int(rows) < 1:
                    raise ValueError(f"rows {rows!r} < 1")
                template = Demand(site=site, task=task, slo_class=slo_class, qps=0.0,
                                  min_accuracy=float(floor), budget_ms=float(budget), tenant=tenant, rows=int(rows))
                seasonal = season
                if season is not None and same and len(row) > 11:
                    prior, current, cycle = list(season.prior), list(season.current), list(season.cycle)
                    for i, p, c, y in row[11]:
                        prior[i] = math.nan if p is None else float(p)
                        current[i], cycle[i] = float(c), int(y)
                    seasonal = replace(season, prior=tuple(prior), current=tuple(current), cycle=tuple(cycle))
                ewma = replace(self._proto, level=float(level), trend=float(trend), n=int(n))
                tracked[(site, task, slo_class, tenant)] = _Tracked(ewma, template, float(at), seasonal)
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise ValueError(f"malformed forecast state: {exc}") from exc
        self._tracked = tracked
        now = state.get("now")
        self._now = float(now) if isinstance(now, int | float) else self._now
        return len(tracked)

    def state(self, site: str, task: str, slo_class: str, tenant: str = "public") -> EwmaTrend | None:
        t = self._tracked.get((site, task, slo_class, tenant))
        return None if t is None else t.state

    def seasonal(self, site: str, task: str, slo_class: str, tenant: str = "public") -> Seasonal | None:
        t = self._tracked.get((site, task, slo_class, tenant))
        return None if t is None else t.seasonal

    def forecast(self, horizon_s: float, now: float | None = None) -> list[Demand]:
        """Forecast demand within ``horizon_s`` of ``now`` (default: the last observation), as
        Demands whose ``qps`` is the forecast and whose ``forecast_why`` says which model gave it."""
        at = now if now is not None else self._now
        out = []
        for key in sorted(self._tracked):
            t = self._tracked[key]
            qps, why = forecast(t.state, horizon_s), f"trend {forecast(t.state, horizon_s):.2f} qps in {horizon_s:g} s"
            if t.seasonal is not None and at is not None:
                peak, lead = seasonal_peak(t.seasonal, at, horizon_s)
                if peak > qps:
                    qps, why = peak, f"seasonal {peak:.2f} qps in {lead:.0f} s (last period at this phase)"
            if qps > 0 and qps >= self._min_qps:
                out.append(replace(t.template, qps=qps, forecast_qps=0.0, forecast_why=why))
        return out

    def with_forecast(self, current: Iterable[Demand], horizon_s: float, now: float | None = None
                      ) -> list[Demand]:
        return with_forecast(current, self.forecast(horizon_s, now))


def with_forecast(current: Iterable[Demand], predicted: Iterable[Demand]) -> list[Demand]:
    """Current demands with ``forecast_qps`` set from ``predicted``; keys only predicted appear
    with ``qps=0`` so placement marks what it loads for them as prewarm."""
    pred: dict[Key, Demand] = {(d.site, d.task, d.slo_class, d.tenant): d for d in predicted}
    out: list[Demand] = []
    for d in current:
        key = (d.site, d.task, d.slo_class, d.tenant)
        p = pred.pop(key, None)
        out.append(replace(d, forecast_qps=p.qps, forecast_why=p.forecast_why) if p is not None else d)
    out.extend(replace(p, qps=0.0, forecast_qps=p.qps) for _, p in sorted(pred.items()))
    return out
