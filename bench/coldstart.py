"""Cold start: proactive placement (seasonal forecast + prewarm) vs reactive-only, same trace, same run.

The trace (``bench.traces.DailyPeak``) is several compressed days. Every edge carries tight traffic
all day; once per day, at the far edge (edge-sin-1, 180 ms RTT to the core), a class arrives that
only a local variant can serve: ``sin-peak`` (5 ms, accuracy >= 0.985). Only the large CNN meets
its accuracy, and the warm floor at an edge holds the tiny MLP (0.967), so the peak needs a
variant that is not warm there unless something loaded it ahead of time. Its budget is shorter
than that variant's profiled load time + compute (5-7 ms here): a query that finds it cold cannot
be served within the SLO, whatever routing then does (load it on the query's path and answer late,
or answer best effort with a less accurate warm variant).

Both modes run the same scheduler knobs, compressed to the bench's day: placement evicts a variant
no demand (current or forecast) needs after ``idle_evict_s``, and agents unload what placement
dropped after ``TIERMESH_AGENT_IDLE_UNLOAD_S`` — so between peaks the edge really drops the CNN.
``proactive`` forecasts each demand key with Holt + a seasonal profile of period = one day, and
prewarms what the forecast needs within ``forecast_horizon_s``; ``reactive`` places for observed
demand only (the first query of each peak is the first thing it knows). The first day's peak is
unforecastable for both (no history): the comparison that matters is the recurring peaks.

A *cold-start SLO violation*: a query that missed its SLO and either (a) was served by a variant
not loaded at the serving site when the query was sent (reply reason ``cold_start``, or by the
agents' load/unload log the pair was not loaded at the send time), or (b) could only be served
locally (its budget is below the RTT from its edge to any other site) and no variant meeting its
accuracy floor was loaded at its edge when it was sent (it was refused, errored or answered best
effort because the right variant was cold).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Panel, RunContext, plot_panels, run_standalone, target, write_result
from bench.geo import QUICK_SITES, TOPOLOGY, holdout, prebuild_home_async
from bench.traces import DailyPeak, Replayed, Trace, TraceSpec, make_trace, peak_windows, replay
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions, site_log
from tiermesh.workload import SloClass
from topology.loader import load_topology_file
from topology.paths import topology_paths
from topology.schema import Topology
from variant_store.catalog import Catalog

__all__ = ["MODES", "PEAK_CLASS", "ModeRun", "cold_spec", "coldstart_rows", "is_cold_violation", "run",
           "run_coldstart"]

MODES = (("proactive", True), ("reactive", False))
PEAK_EDGE = "edge-sin-1"
TASK = "digit-classification"
PEAK_CLASS = SloClass("sin-peak", latency_ms=5, min_accuracy=0.985, share=0.0)
TIGHT = SloClass("tight", latency_ms=10, min_accuracy=0.90, share=1.0)
Intervals = dict[tuple[str, str], list[tuple[float, float]]]  # (site, variant) -> [(loaded, unloaded)]


def cold_spec(quick: bool, edges: tuple[str, ...]) -> TraceSpec:
    """``days`` compressed days; the peak starts mid-day (after the mesh has settled) for 5 s."""
    day = 15.0 if quick else 30.0
    days = 2 if quick else 4
    return TraceSpec(edges=edges, duration_s=day * days, day_s=day, base_qps=2.0, peak_qps=4.0,
                     classes=(TIGHT,), seed=7, max_events=4000,
                     peaks=DailyPeak(PEAK_EDGE, PEAK_CLASS, start_s=0.5 * day, length_s=5.0, qps=10.0,
                                     burst=10, burst_gap_s=0.002))


def mesh_knobs(spec: TraceSpec) -> dict[str, Any]:
    """Scheduler and agent timing compressed like the trace's day (same for both modes)."""
    return {"interval_s": 0.5, "forecast_horizon_s": 4.0, "forecast_period_s": spec.day_s, "forecast_bin_s": 1.0,
            "idle_evict_s": 2.0, "min_residency_s": 2.0,
            "agent_env": {"TIERMESH_AGENT_IDLE_UNLOAD_S": "1", "TIERMESH_AGENT_DEMAND_WINDOW_S": "3",
                          "TIERMESH_LOG_FORMAT": "json"}}


@dataclass(slots=True)
class ModeRun:
    name: str
    records: list[Replayed]
    intervals: Intervals
    accuracy: dict[str, float]          # variant -> measured accuracy (catalog)
    events: list[dict[str, Any]]        # the scheduler's placement events (wall-clock ts)
    cold_starts: int                    # loads the agents counted


def read_intervals(home: Path, sites: list[str]) -> Intervals:
    """Loaded intervals per (site, variant) from the agents' JSON logs (load / unload completions)."""
    out: Intervals = {}
    for site in sites:
        path = site_log(home, site)
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if '"event": "load"' not in line and '"event": "evict"' not in line:
                    continue
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    rec = json.loads(line)
                    spans = out.setdefault((str(rec["site"]), str(rec["variant"])), [])
                    ts = float(rec["ts"])
                    if rec["event"] == "load":
                        spans.append((ts, math.inf))
                    elif spans and math.isinf(spans[-1][1]):
                        spans[-1] = (spans[-1][0], ts)
    return out


def loaded_at(iv: Intervals, site: str, variant: str, t: float) -> bool:
    return any(a <= t < b for a, b in iv.get((site, variant), ()))


def qualifying_loaded(run: ModeRun, site: str, min_accuracy: float, t: float) -> bool:
    return any(loaded_at(run.intervals, s, v, t) for (s, v) in run.intervals
               if s == site and run.accuracy.get(v, 0.0) >= min_accuracy)


def local_only_budget(topo: Topology, edge: str, sites: list[str]) -> float:
    """Budgets below this can only be met at ``edge`` itself (the RTT to its nearest other site)."""
    return min((topology_paths(topo).rtt(edge, s) for s in sites if s != edge), default=math.inf)


def is_cold_violation(r: Replayed, run: ModeRun, classes: dict[str, SloClass], local_below: dict[str, float]
                      ) -> bool:
    """The module docstring's definition."""
    if r.slo_met:
        return False
    if r.ok and (r.reason == "cold_start" or not loaded_at(run.intervals, r.site, r.variant, r.sent_wall)):
        return True
    cls = classes[r.event.slo_class]
    return (r.budget_ms < local_below.get(r.event.edge, 0.0)
            and not qualifying_loaded(run, r.event.edge, cls.min_accuracy, r.sent_wall))


async def run_mode(name: str, proactive: bool, trace: Trace, x: np.ndarray, y: np.ndarray, prebuilt: Path,
                   workdir: Path, sites: list[str] | None) -> ModeRun:
    home = workdir / name
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(prebuilt, home)
    opts = MeshOptions(topology=TOPOLOGY, home=home, mode="tiermesh", proactive=proactive, sites=sites,
                       agent_log_level="INFO", **mesh_knobs(trace.spec))
    async with LocalMesh(opts) as mesh:
        await mesh.wait_live()
        await mesh.wait_placed(timeout=20.0)
        assert mesh.store is not None
        accuracy = {v.variant_id: v.accuracy for v in await Catalog(mesh.store).list_variants(TASK)}
        records = await replay(trace, mesh.edge_urls(), x, y)
        cold = 0
        for site in mesh.sites:
            kv_ = await mesh.store.get(f"live/{site}")
            cold += int((kv_.value if kv_ is not None else {}).get("cold_starts", 0))
        events = list(mesh.scheduler.events) if mesh.scheduler is not None else []
        names = list(mesh.sites)
    return ModeRun(name, records, read_intervals(home, names), accuracy, events, cold)


def _rate(num: int, den: int) -> float:
    return round(num / den, 4) if den else float("nan")


def peak_breakdown(run: ModeRun, trace: Trace, cold: set[int]) -> list[dict[str, Any]]:
    pk = trace.spec.peaks
    assert pk is not None
    recs = run.records
    out = []
    for k, (start, end) in enumerate(peak_windows(trace.spec)):
        ps = [i for i, r in enumerate(recs)
              if r.event.slo_class == pk.slo.name and start <= r.event.t < end]
        if not ps:
            continue
        first = min(recs[i].sent_wall for i in ps)
        # when a variant meeting the peak's accuracy became loaded at the edge for this peak
        ready = [a for (s, v), spans in run.intervals.items() if s == pk.edge
                 and run.accuracy.get(v, 0.0) >= pk.slo.min_accuracy for a, b in spans if b > first - 1e-9]
        ready_at = min(ready, default=math.nan)
        prewarms = [{"t_s": round(float(e["ts"]) - first, 2), "variant": e.get("variant_id"),
                     "reason": e.get("reason")}
                    for e in run.events if e.get("site") == pk.edge and e.get("action") == "prewarm"
                    and first - trace.spec.day_s / 2 <= float(e.get("ts", 0.0)) <= first + (end - start)]
        out.append({
            "peak": k + 1, "queries": len(ps), "slo_met": sum(recs[i].slo_met for i in ps),
            "cold_start_violations": sum(1 for i in ps if i in cold),
            "attainment": _rate(sum(recs[i].slo_met for i in ps), len(ps)),
            # > 0: a qualifying variant was loaded that many seconds before the peak's first query
            "ready_before_first_query_s": round(first - ready_at, 3) if math.isfinite(ready_at) else None,
            "prewarm_events": prewarms,
        })
    return out


def coldstart_rows(runs: list[ModeRun], trace: Trace, topo: Topology, sites: list[str]) -> list[dict[str, Any]]:
    classes = trace.classes()
    local_below = {e: local_only_budget(topo, e, sites) for e in trace.spec.edges}
    pk = trace.spec.peaks
    assert pk is not None
    rows = []
    for run in runs:
        recs = run.records
        cold = {i for i, r in enumerate(recs) if is_cold_violation(r, run, classes, local_below)}
        peaks = peak_breakdown(run, trace, cold)
        peak_recs = [r for r in recs if r.event.slo_class == pk.slo.name]
        unloads = sum(1 for (s, v), spans in run.intervals.items() if s == pk.edge
                      and run.accuracy.get(v, 0.0) >= pk.slo.min_accuracy for _, b in spans if math.isfinite(b))
        rows.append({
            "mode": run.name, "queries": len(recs), "violations": sum(1 for r in recs if not r.slo_met),
            "cold_start_violations": len(cold),
            "cold_start_violations_recurring_peaks": sum(p["cold_start_violations"] for p in peaks[1:]),
            "cold_start_violations_first_peak": peaks[0]["cold_start_violations"] if peaks else 0,
            "peak_queries": len(peak_recs),
            "peak_attainment": _rate(sum(r.slo_met for r in peak_recs), len(peak_recs)),
            "slo_attainment": _rate(sum(r.slo_met for r in recs), len(recs)),
            "errors": sum(1 for r in recs if not r.ok),
            "errors_by": dict(Counter(f"{r.event.slo_class}/{r.error}" for r in recs if not r.ok)),
            "violations_by": dict(Counter(
                f"{r.event.slo_class}/" + ("error" if not r.ok else "best_effort" if r.best_effort else "late")
                for r in recs if not r.slo_met)),
            "agent_cold_starts": run.cold_starts,
            "peak_variant_unloads_at_edge": unloads,
            "prewarm_events": sum(1 for e in run.events if e.get("action") == "prewarm"),
            "peaks": peaks,
        })
    return rows


async def run_coldstart(ctx: RunContext) -> Path:
    topo = load_topology_file(TOPOLOGY)
    sites = list(QUICK_SITES) if ctx.quick else sorted(topo.sites)
    edges = tuple(sorted(n for n in sites if topo.sites[n].tier == "edge"))
    x, y = holdout()
    trace = make_trace(cold_spec(ctx.quick, edges), len(x))
    runs: list[ModeRun] = []
    with tempfile.TemporaryDirectory(prefix="tiermesh-cold-") as tmp:
        prebuilt = Path(tmp) / "prebuilt"
        await prebuild_home_async(prebuilt)
        for name, proactive in MODES:
            t0 = time.perf_counter()
            runs.append(await run_mode(name, proactive, trace, x, y, prebuilt, Path(tmp),
                                       sites if ctx.quick else None))
            print(f"   coldstart {name}: {len(runs[-1].records)} queries in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    rows = coldstart_rows(runs, trace, topo, sites)
    pro, rea = rows
    # no reactive cold-start violations: the scenario did not discriminate, the ratio is not measured
    ratio = (pro["cold_start_violations"] / rea["cold_start_violations"]
             if rea["cold_start_violations"] else float("nan"))
    fewer = float(rea["cold_start_violations"] - pro["cold_start_violations"])
    rec_ratio = (pro["cold_start_violations_recurring_peaks"] / rea["cold_start_violations_recurring_peaks"]
                 if rea["cold_start_violations_recurring_peaks"] else float("nan"))
    targets = [
        # issue 5's Done-when: fewer cold-start SLO violations than reactive-only, same trace, same run
        target("cold-start SLO violations, reactive minus proactive", fewer, 1.0, op=">=", unit="queries"),
        target("cold-start SLO violations, proactive / reactive", ratio, 0.75, op="<=", unit="x"),
        target("cold-start SLO violations at recurring peaks (day >= 2), proactive / reactive", rec_ratio, 0.25,
               op="<=", unit="x"),
        target("peak-class attainment, proactive minus reactive",
               float(pro["peak_attainment"]) - float(rea["peak_attainment"]), 0.0, op=">="),
    ]
    n_peaks = max(len(r["peaks"]) for r in rows)
    groups = [f"peak {k + 1}" for k in range(n_peaks)]

    def per_peak(row: dict[str, Any], key: str, scale: float = 1.0) -> list[float]:
        vals: dict[int, float] = {p["peak"]: p[key] for p in row["peaks"] if p[key] is not None}
        return [scale * vals.get(k + 1, math.nan) for k in range(n_peaks)]

    plot_panels(ctx.results_dir / "coldstart.png", "Cold start at a recurring peak: proactive vs reactive placement", [
        Panel("cold-start SLO violations per peak", "queries", groups,
              {r["mode"]: per_peak(r, "cold_start_violations") for r in rows},
              bar_text={r["mode"]: [str(p["cold_start_violations"]) for p in r["peaks"]] for r in rows}),
        Panel("peak-class SLO attainment per peak", "%", groups,
              {r["mode"]: per_peak(r, "attainment", 100.0) for r in rows})])
    spec = trace.spec
    assert spec.peaks is not None
    knobs = {k: v for k, v in mesh_knobs(spec).items() if k != "agent_env"}
    notes = (f"{len(trace.events)} queries, {spec.duration_s / spec.day_s:.0f} compressed days of {spec.day_s:g} s at "
             f"{', '.join(edges)}; tight ({TIGHT.latency_ms:g} ms, >= {TIGHT.min_accuracy}) all day at "
             f"{spec.base_qps:g}-{spec.peak_qps:g} qps per edge; once a day {spec.peaks.slo.name} "
             f"({spec.peaks.slo.latency_ms:g} ms, >= {spec.peaks.slo.min_accuracy}) at {spec.peaks.edge}, "
             f"{spec.peaks.qps:g} qps for {spec.peaks.length_s:g} s from {spec.peaks.start_s:g} s into the day. "
             f"Same trace, same run, fresh mesh per mode; knobs {knobs}; agents unload a dropped variant after 1 s "
             "idle. Cold-start SLO violation: SLO missed and served by a variant not loaded at its site when "
             "sent, or local-only and no variant meeting its accuracy loaded at its edge when sent. "
             f"Ratio {pro['cold_start_violations']} / {rea['cold_start_violations']}; recurring peaks "
             f"{pro['cold_start_violations_recurring_peaks']} / {rea['cold_start_violations_recurring_peaks']}.")
    return write_result(ctx, "coldstart", rows, targets, notes=notes)


def run(quick: bool) -> dict[str, Any]:
    """Run the cold-start benchmark; returns the result document it wrote."""
    return run_standalone("coldstart", quick, run_coldstart)


if __name__ == "__main__":
    import sys

    result = run("--quick" in sys.argv[1:])
    for row in result["rows"]:
        print({k: v for k, v in row.items() if k != "peaks"})
        for p in row["peaks"]:
            print("   ", {k: v for k, v in p.items() if k != "prewarm_events"})
            for e in p["prewarm_events"][:3]:
                print("      prewarm", e)
    for t in result["targets"]:
        print(("MET " if t["met"] else "MISS") + f"  {t['name']}: {t['measured']} {t['op']} {t['target']}")
