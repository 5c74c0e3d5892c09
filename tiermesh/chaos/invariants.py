"""What a chaos run must show, checked from the workload's own records (pure: no clocks, no I/O).

Invariants (each a list of violations; a run passes when every list is empty):

- ``exactly_once``: every query fired has one record, its answer names the id it was sent under
  (no answer to another query, none twice), and no id appears twice;
- ``in_time``: every query was answered, or failed with a typed error (a ``mesh.errors`` code, never
  ``internal``), within its budget + ``LATE_S`` as the client measured it: none hung;
- ``accuracy``: no answer came from a variant below the query's accuracy floor unless flagged best effort;
- ``recovery``: after each fault is healed, SLO attainment over a sliding window of ``WINDOW_S`` is
  back to ``TARGET`` within the run's recovery bound (a fault's recovery time is from its heal to the
  start of the first such window; the baseline before the first fault must reach it too).

Attainment of a query: answered within its budget (edge-measured) and not best effort; queries sent to
an edge whose agent was down at the time cannot be answered by that edge and are left out of the
windows (they must still fail typed and in time: ``in_time``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mesh.errors import error_from_code
from tiermesh.workload import QueryRecord

__all__ = ["LATE_S", "TARGET", "WINDOW_S", "FaultWindow", "Verdict", "attained", "check", "timeline"]

LATE_S = 1.0
TARGET = 0.95
WINDOW_S = 3.0
STEP_S = 0.5
MIN_WINDOW_QUERIES = 10  # a window with fewer queries says nothing either way


@dataclass(frozen=True, slots=True)
class FaultWindow:
    label: str
    start_s: float
    end_s: float                      # when its heal finished
    down_edge: str | None = None      # an edge whose agent was down (not running) from start_s ...
    down_until_s: float | None = None  # ... to this (default end_s): queries sent to it then are excluded


@dataclass(slots=True)
class Verdict:
    exactly_once: list[str] = field(default_factory=list)
    in_time: list[str] = field(default_factory=list)
    accuracy: list[str] = field(default_factory=list)
    recovery: list[str] = field(default_factory=list)
    recovery_s: dict[str, float | None] = field(default_factory=dict)
    baseline: float | None = None

    @property
    def ok(self) -> bool:
        return not (self.exactly_once or self.in_time or self.accuracy or self.recovery)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "exactly_once": self.exactly_once[:20], "in_time": self.in_time[:20],
                "accuracy": self.accuracy[:20], "recovery": self.recovery, "recovery_s": self.recovery_s,
                "baseline_attainment": self.baseline}


def attained(r: QueryRecord) -> bool:
    return r.met


def _typed(code: str) -> bool:
    return bool(code) and code != "internal" and error_from_code(code, "").code == code


def _excluded(r: QueryRecord, faults: Sequence[FaultWindow]) -> bool:
    return any(f.down_edge == r.edge and f.start_s <= r.t <= (f.end_s if f.down_until_s is None else f.down_until_s)
               + 1.0 for f in faults)


def timeline(records: Sequence[QueryRecord], faults: Sequence[FaultWindow], end_s: float,
             window_s: float = WINDOW_S, step_s: float = STEP_S) -> list[tuple[float, float | None, int]]:
    """(window start, attainment or None when under ``MIN_WINDOW_QUERIES``, queries) every ``step_s``."""
    rs = sorted((r for r in records if not _excluded(r, faults)), key=lambda r: r.t)
    out: list[tuple[float, float | None, int]] = []
    t = 0.0
    lo = 0
    while t + window_s <= end_s + 1e-9:
        while lo < len(rs) and rs[lo].t < t:
            lo += 1
        hi = lo
        met = 0
        while hi < len(rs) and rs[hi].t < t + window_s:
            met += attained(rs[hi])
            hi += 1
        n = hi - lo
        out.append((round(t, 3), met / n if n >= MIN_WINDOW_QUERIES else None, n))
        t += step_s
    return out


def check(records: Sequence[QueryRecord], fired: int, faults: Sequence[FaultWindow], *, end_s: float,
          recovery_bound_s: float) -> Verdict:
    v = Verdict()
    if len(records) != fired:
        v.exactly_once.append(f"{fired} queries fired, {len(records)} records")
    ids = Counter(r.request_id for r in records)
    v.exactly_once += [f"request id {i} recorded {n} times" for i, n in ids.items() if n > 1]
    v.exactly_once += [f"{r.request_id} answered as {r.reply_id!r}" for r in records
                       if r.ok and r.reply_id != r.request_id]
    for r in records:
        if r.client_ms > r.budget_ms + LATE_S * 1000.0:
            v.in_time.append(f"{r.request_id} ({r.slo_class}) {'answered' if r.ok else r.error} after "
                             f"{r.client_ms:.0f} ms, budget {r.budget_ms:.0f} ms, at t={r.t:.1f}")
        if not r.ok and not _typed(r.error):
            v.in_time.append(f"{r.request_id} failed untyped: {r.error!r} at t={r.t:.1f}")
        if r.ok and not r.best_effort and r.accuracy < r.min_accuracy:
            v.accuracy.append(f"{r.request_id} served by {r.variant} ({r.accuracy:.4f}) below "
                              f"{r.min_accuracy:.4f}, not flagged best effort")
    line = timeline(records, faults, end_s)
    first = min((f.start_s for f in faults), default=end_s)
    base = [a for t, a, _ in line if a is not None and t + WINDOW_S <= first]
    v.baseline = max(base) if base else None
    if v.baseline is None or v.baseline < TARGET:
        v.recovery.append(f"before the first fault attainment never reached {TARGET:.0%} "
                          f"(best window {v.baseline})")
    for f in faults:
        back = next((t for t, a, _ in line if t >= f.end_s and a is not None and a >= TARGET), None)
        took = None if back is None else round(back - f.end_s, 2)
        v.recovery_s[f.label] = took
        if took is None or took > recovery_bound_s:
            v.recovery.append(f"{f.label} (healed at {f.end_s:.1f} s): attainment back to {TARGET:.0%} "
                              f"after {took} s, bound {recovery_bound_s} s")
    return v
