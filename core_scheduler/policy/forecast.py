"""Demand forecast for proactive placement: Holt's linear smoothing (level + trend) per key.

A rising ramp is forecast above its last value, so placement can load ("prewarm") a variant
before the rise arrives instead of paying the cold start on the first queries of the rise.

:class:`EwmaTrend` is an immutable state; :func:`update` and :func:`forecast` are pure.
``dt`` and horizons are seconds; the trend is in qps per second so irregular observation
intervals stay meaningful. :class:`DemandForecaster` keeps one state per (site, task,
slo_class, tenant) and turns them into :class:`~core_scheduler.policy.placement.Demand` values;
it reads no clock (``now`` is an argument).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from core_scheduler.policy.placement import Demand

__all__ = ["DemandForecaster", "EwmaTrend", "forecast", "update", "with_forecast"]

Key = tuple[str, str, str, str]  # site, task, slo_class, tenant


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
class _Tracked:
    state: EwmaTrend
    template: Demand   # latest SLO parameters seen for the key
    at: float          # time of the last observation


class DemandForecaster:
    """One :class:`EwmaTrend` per demand key, fed with the full demand list each round."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3, forget_below_qps: float = 0.01) -> None:
        self._proto = EwmaTrend(alpha=alpha, beta=beta)
        self._forget = forget_below_qps
        self._tracked: dict[Key, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._tracked)

    def observe(self, demands: Iterable[Demand], now: float) -> None:
        """Record one round of observed demand; a known key missing from it observed 0 qps."""
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
            if cur is None and new.level < self._forget and forecast(new, 0.0) < self._forget:
                self._tracked.pop(key, None)  # traffic gone: bound the memory
                continue
            self._tracked[key] = _Tracked(new, template, now)

    def state(self, site: str, task: str, slo_class: str, tenant: str = "public") -> EwmaTrend | None:
        t = self._tracked.get((site, task, slo_class, tenant))
        return None if t is None else t.state

    def forecast(self, horizon_s: float) -> list[Demand]:
        """Forecast demand ``horizon_s`` ahead, as Demands whose ``qps`` is the forecast."""
        out = []
        for key in sorted(self._tracked):
            t = self._tracked[key]
            qps = forecast(t.state, horizon_s)
            if qps > 0:
                out.append(replace(t.template, qps=qps, forecast_qps=0.0))
        return out

    def with_forecast(self, current: Iterable[Demand], horizon_s: float) -> list[Demand]:
        return with_forecast(current, self.forecast(horizon_s))


def with_forecast(current: Iterable[Demand], predicted: Iterable[Demand]) -> list[Demand]:
    """Current demands with ``forecast_qps`` set from ``predicted``; keys only predicted appear
    with ``qps=0`` so placement marks what it loads for them as prewarm."""
    pred: dict[Key, Demand] = {(d.site, d.task, d.slo_class, d.tenant): d for d in predicted}
    out: list[Demand] = []
    for d in current:
        key = (d.site, d.task, d.slo_class, d.tenant)
        p = pred.pop(key, None)
        out.append(replace(d, forecast_qps=p.qps) if p is not None else d)
    out.extend(replace(p, qps=0.0, forecast_qps=p.qps) for _, p in sorted(pred.items()))
    return out
