"""Demand an agent observes, by task and SLO class, reported in its heartbeat for the scheduler.

SLO classes bucket requests so the scheduler plans for a few classes, not every distinct SLO. A request
of several rows is planned apart from one-row requests of the same SLO, by the power of two its rows
round up to (``loose-lo-x64``: 33 to 64 rows): its compute is that of its rows, so a site that answers
one row within the SLO may not answer 64, and placement must know which demand brings which.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from core_scheduler.state.heartbeat import DemandSample
from mesh.types import SLO

__all__ = ["DemandMeter", "demand_class", "rows_bucket", "slo_class"]

_LATENCY_BUCKETS = ((25.0, "tight"), (120.0, "medium"))
_ACCURACY_BUCKETS = ((0.98, "hi"), (0.95, "mid"))


def slo_class(slo: SLO) -> str:
    """e.g. ``tight-lo``: latency bucket then accuracy bucket."""
    lat = next((name for bound, name in _LATENCY_BUCKETS if slo.latency_ms <= bound), "loose")
    acc = next((name for bound, name in _ACCURACY_BUCKETS if slo.min_accuracy >= bound), "lo")
    return f"{lat}-{acc}"


def rows_bucket(rows: int) -> int:
    """The rows a request of ``rows`` rows is planned at: 1, else the next power of two (33-64 -> 64)."""
    return 1 if rows <= 1 else 1 << (rows - 1).bit_length()


def demand_class(slo: SLO, rows: int = 1) -> str:
    """The class demand is counted in: the SLO's class, and the rows bucket when above one row."""
    bucket = rows_bucket(rows)
    return slo_class(slo) if bucket == 1 else f"{slo_class(slo)}-x{bucket}"


@dataclass(slots=True)
class _Series:
    stamps: deque[float] = field(default_factory=deque)
    min_budget_ms: float = float("inf")
    max_accuracy: float = 0.0
    max_rows: int = 1


class DemandMeter:
    """Sliding-window arrival rate per (task, SLO class). Time is passed in (testable)."""

    def __init__(self, window_s: float = 10.0, max_events: int = 100_000) -> None:
        self.window_s = window_s
        self.max_events = max_events
        self._series: dict[tuple[str, str, str], _Series] = {}

    def record(self, task: str, slo: SLO, now: float, tenant: str = "public", rows: int = 1) -> None:
        s = self._series.setdefault((task, demand_class(slo, rows), tenant), _Series())
        s.stamps.append(now)
        if len(s.stamps) > self.max_events:
            s.stamps.popleft()
        s.min_budget_ms = min(s.min_budget_ms, slo.latency_ms)
        s.max_accuracy = max(s.max_accuracy, slo.min_accuracy)
        s.max_rows = max(s.max_rows, rows)

    def snapshot(self, now: float) -> list[DemandSample]:
        out: list[DemandSample] = []
        for (task, cls, tenant), s in sorted(self._series.items()):
            while s.stamps and s.stamps[0] < now - self.window_s:
                s.stamps.popleft()
            if not s.stamps:
                continue
            out.append(DemandSample(task=task, slo_class=cls, tenant=tenant, qps=len(s.stamps) / self.window_s,
                                    budget_ms=s.min_budget_ms, min_accuracy=s.max_accuracy,
                                    rows=s.max_rows))
        return out
