"""The cascade benchmark's pure parts (:mod:`bench.cascade` runs the meshes): the trace's queries, one query's
outcome, an arm's figures per task, the issue's targets and the plot. No I/O but the plot's file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import percentile, target

__all__ = ["ARMS", "BUDGET_MS", "CASCADES", "DIGITS", "EDGES", "LARGE", "LARGE_AGAIN", "ROWS", "SMALL", "TASKS",
           "TEXT", "Event", "Outcome", "arm_row", "make_events", "plot", "targets"]

DIGITS, TEXT = "digit-classification", "text-topic"
TASKS = (DIGITS, TEXT)
EDGES = ("edge-fra-1", "edge-nyc-1", "edge-par-1")
# Digits: 8 rows a query. On this machine every digits variant computes one row within its profile's resolution
# (0.05 ms), so for one row the large variant alone is as cheap as the small one and routing never picks the cascade
# (a first run of this benchmark at one row: 0 of 85 queries; tests/system/test_cascade_mesh.py says the same); at
# 8 rows the small variant is the cheaper compute. Text: one row (an encoder's compute grows with the rows, so more
# rows change no ratio, and a tenth of a core at the edge runs several rows of an encoder slowly).
ROWS = {DIGITS: 8, TEXT: 1}
BUDGET_MS = {DIGITS: 150.0, TEXT: 400.0}
LARGE, SMALL, CASCADES, LARGE_AGAIN = "large only", "small only", "tiermesh + cascades", "large only (again)"
ARMS = (LARGE, SMALL, CASCADES, LARGE_AGAIN)
MAX_INFLIGHT = 32


@dataclass(frozen=True, slots=True)
class Event:
    t: float                  # seconds from the replay's start
    edge: str
    task: str
    rows: tuple[int, ...]     # indices into the task's held-out half


@dataclass(slots=True)
class Outcome:
    event: Event
    budget_ms: float
    ok: bool = False
    error: str = ""
    total_ms: float = math.nan
    site: str = ""
    variant: str = ""
    reason: str = ""
    best_effort: bool = False
    correct: int = 0                 # rows answered right
    usd: float = 0.0                 # price x compute, over every stage
    compute_s: float = 0.0
    stage_sites: tuple[str, ...] = ()
    rows_escalated: int = 0          # rows a cascade sent to a later stage
    rows_remote: int = 0             # rows answered at a site other than the door's

    @property
    def crossed_wan(self) -> bool:
        return self.ok and any(s != self.event.edge for s in (*self.stage_sites, self.site))

    @property
    def slo_met(self) -> bool:
        return self.ok and not self.best_effort and self.total_ms <= self.budget_ms


def make_events(*, duration_s: float, qps: float, sizes: dict[str, int], rows: dict[str, int],
                seed: int = 33) -> list[Event]:
    """Poisson arrivals at ``qps`` per (edge, task), each query ``rows[task]`` distinct held-out rows of the
    task's ``sizes[task]``; deterministic in ``seed``, so every arm is offered the same queries."""
    rng = np.random.default_rng(seed)
    out: list[Event] = []
    for edge in EDGES:
        for task in TASKS:
            t = 0.0
            while True:
                t += float(rng.exponential(1.0 / qps))
                if t >= duration_s:
                    break
                picked = rng.choice(sizes[task], size=min(rows[task], sizes[task]), replace=False)
                out.append(Event(round(t, 6), edge, task, tuple(int(i) for i in picked)))
    out.sort(key=lambda e: (e.t, e.edge, e.task))
    return out


# ------------------------------------------------------------------ figures (pure)


def arm_row(arm: str, task: str, outs: list[Outcome]) -> dict[str, Any]:
    """One result row: an arm's figures for one task (see the module docstring)."""
    rs = [o for o in outs if o.event.task == task]
    ok = [o for o in rs if o.ok]
    rows = sum(len(o.event.rows) for o in ok)
    acc = sum(o.correct for o in ok) / rows if rows else float("nan")
    casc = [o for o in ok if o.reason.startswith("cascade_")]
    casc_rows = sum(len(o.event.rows) for o in casc)
    lat = [o.total_ms for o in ok]
    served: dict[str, int] = {}
    for o in ok:
        key = "+".join(dict.fromkeys(o.stage_sites)) + f" {o.reason}" if o.stage_sites else f"{o.site}/{o.variant}"
        served[key] = served.get(key, 0) + 1
    return {
        "arm": arm, "task": task, "queries": len(rs), "answered": len(ok), "rows_scored": rows,
        "accuracy": round(acc, 4) if rows else float("nan"),
        "accuracy_se": round(math.sqrt(acc * (1 - acc) / rows), 4) if rows else float("nan"),
        "wan_share": round(sum(o.crossed_wan for o in ok) / len(ok), 4) if ok else float("nan"),
        "wan_row_share": round(sum(o.rows_remote for o in ok) / rows, 4) if rows else float("nan"),
        "usd_per_1k": float(f"{1000 * sum(o.usd for o in ok) / len(ok):.4g}") if ok else float("nan"),
        "compute_s_per_1k": round(1000 * sum(o.compute_s for o in ok) / len(ok), 4) if ok else float("nan"),
        "slo_attainment": round(sum(o.slo_met for o in rs) / len(rs), 4) if rs else float("nan"),
        "latency_attainment": round(sum(o.ok and o.total_ms <= o.budget_ms for o in rs) / len(rs), 4)
        if rs else float("nan"),
        "best_effort": sum(o.best_effort for o in ok),
        "p50_ms": round(percentile(lat, 50), 2), "p99_ms": round(percentile(lat, 99), 2),
        "cascade_queries": len(casc),
        "escalated_queries": round(sum(o.reason == "cascade_escalated" for o in casc) / len(casc), 4)
        if casc else float("nan"),
        "escalated_rows": round(sum(o.rows_escalated for o in casc) / casc_rows, 4) if casc_rows else float("nan"),
        "errors": {e: sum(o.error == e for o in rs) for e in sorted({o.error for o in rs if not o.ok})},
        "served_by": dict(sorted(served.items(), key=lambda kv: -kv[1])[:4]),
    }


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets per task, against ``large only`` (the mean of its two runs when both ran)."""
    out = []
    for task in TASKS:
        by = {r["arm"]: r for r in rows if r["task"] == task}
        if CASCADES not in by or LARGE not in by:
            continue
        c = by[CASCADES]
        larges = [by[a] for a in (LARGE, LARGE_AGAIN) if a in by]

        def mean(key: str, rs: list[dict[str, Any]] = larges) -> float:
            vals = [float(r[key]) for r in rs if r[key] is not None and np.isfinite(r[key])]
            return float(np.mean(vals)) if vals else float("nan")

        gap = (mean("accuracy") - float(c["accuracy"])) * 100
        se = math.hypot(float(c["accuracy_se"]), mean("accuracy_se")) * 100
        out.append(target(f"{task}: accuracy points below large only (cascades {c['accuracy']}, large "
                          f"{round(mean('accuracy'), 4)}; standard error of the gap {se:.2f} points)", gap, 0.3,
                          unit="points"))
        # how many of the arm's answers a cascade gave: a figure met without one is routing's, not a cascade's
        by_cascade = f"{c['cascade_queries']} of {c['answered']} answers by a cascade"
        out.append(target(f"{task}: share of cascade-arm queries over the WAN ({by_cascade})", float(c["wan_share"]),
                          0.40))
        secs = mean("compute_s_per_1k")
        runs_s = ", ".join(f"{float(r['compute_s_per_1k']):.3g}" for r in larges)
        ratio = float(c["compute_s_per_1k"]) / secs if secs > 0 else float("nan")
        out.append(target(f"{task}: resource-seconds (reported compute) / large only's ({by_cascade}; large only's "
                          f"runs: {runs_s} s per 1k)", ratio, 0.6, unit="x"))
        usd = mean("usd_per_1k")
        runs = ", ".join(f"{float(r['usd_per_1k']):.3g}" for r in larges)
        out.append(target(f"{task}: cost (price x compute) / large only's ({by_cascade}; large only's runs: {runs} "
                          "USD per 1k)", float(c["usd_per_1k"]) / usd if usd > 0 else float("nan"), 0.6, unit="x"))
        att = mean("slo_attainment")
        spread = abs(float(larges[0]["slo_attainment"]) - float(larges[-1]["slo_attainment"]))
        out.append(target(f"{task}: SLO attainment, cascades minus large only (its two runs differ by "
                          f"{spread:.3f})", round(float(c["slo_attainment"]) - att, 4), 0.0, op=">="))
    return out


def plot(path: Path, rows: list[dict[str, Any]]) -> Path:
    from bench.common import Panel, plot_panels

    groups = [a for a in ARMS if any(r["arm"] == a for r in rows)]

    def series(key: str, scale: float = 1.0) -> dict[str, list[float]]:
        by = {(r["arm"], r["task"]): r for r in rows}
        return {task: [float(by[(a, task)][key]) * scale if by.get((a, task)) and by[(a, task)][key] is not None
                       else float("nan") for a in groups] for task in TASKS}

    labels = [g.replace(" + ", "\n+ ").replace(" (", "\n(") for g in groups]
    return plot_panels(path, "Cascades vs one variant, capped geo mesh (same trace)", [
        Panel("accuracy on held-out rows", "%", labels, series("accuracy", 100)),
        Panel("queries over the WAN", "%", labels, series("wan_share", 100)),
        Panel("cost per 1k queries (price x compute)", "USD", labels, series("usd_per_1k")),
        Panel("SLO attainment", "%", labels, series("slo_attainment", 100)),
        Panel("p99 latency", "ms", labels, series("p99_ms")),
    ])
