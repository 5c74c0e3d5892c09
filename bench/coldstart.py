"""Cold start: proactive placement (forecast + prewarm) vs reactive-only, on the geo spike trace.

Both runs use tiermesh routing on the same trace and harness (``bench.geo``), one after the other:
``MeshOptions(proactive=True)`` (the scheduler forecasts demand with Holt smoothing and prewarms
what the forecast needs, ``forecast_horizon_s`` ahead) and ``proactive=False`` (placement covers
observed demand only).

The spike is balanced traffic (60 ms, accuracy >= 0.97) at the far edge (Singapore, 180 ms RTT
to the core): only a local variant can meet it, and the warm floor there holds only the small
INT8 MLP (accuracy 0.967), so the spike needs a variant that is not warm where it lands. Its rate
ramps up linearly before the cliff, so a forecaster can see it coming.

A *cold-start SLO violation* is a query that missed its SLO and was served by a variant that was
not loaded at the serving site when the query was sent: its reply's reason is ``cold_start``
(routing saw the variant unloaded) or that (site, variant)'s first load, by the agent's log,
completed after the send time (``bench.geo.cold_on_arrival``).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Panel, RunContext, plot_panels, target, write_result
from bench.geo import (
    QUICK_SITES,
    TOPOLOGY,
    SystemRun,
    cold_on_arrival,
    geo_spec,
    holdout,
    prebuild_home_async,
    run_system,
)
from bench.traces import Trace, make_trace
from topology.loader import load_topology_file

__all__ = ["MODES", "coldstart_row", "run", "run_coldstart"]

MODES = (("proactive", True), ("reactive", False))


def coldstart_row(run: SystemRun, trace: Trace) -> dict[str, Any]:
    sp = trace.spec.spike
    assert sp is not None
    recs = run.records
    t0 = min((r.sent_wall - r.event.t for r in recs), default=0.0)
    viol = [r for r in recs if not r.slo_met]
    cold = [r for r in viol if cold_on_arrival(r, run.loads)]
    spike = [r for r in recs if r.event.edge == sp.edge and r.event.slo_class == sp.slo_class]
    in_window = [r for r in spike if sp.ramp_start_s <= r.event.t < sp.spike_end_s]
    cliff = [r for r in spike if sp.cliff_s <= r.event.t < sp.spike_end_s]
    served = {(r.site, r.variant) for r in spike if r.ok and r.site == sp.edge}
    first_load = min((min(run.loads[p]) for p in served if run.loads.get(p)), default=float("nan"))
    first_query = min((r.sent_wall for r in spike), default=float("nan"))
    prewarms = [e for e in run.events if e.get("action") == "prewarm"]
    spike_loads = [e for e in run.events if e.get("site") == sp.edge and e.get("action") in ("load", "prewarm")]
    return {
        "mode": run.name, "queries": len(recs), "violations": len(viol),
        "cold_start_violations": len(cold),
        "cold_start_violations_spike": sum(1 for r in cold if r.event.edge == sp.edge
                                           and r.event.slo_class == sp.slo_class),
        "spike_queries": len(spike),
        "spike_attainment": round(sum(r.slo_met for r in spike) / len(spike), 4) if spike else float("nan"),
        "spike_window_attainment": (round(sum(r.slo_met for r in in_window) / len(in_window), 4)
                                    if in_window else float("nan")),
        "cliff_attainment": round(sum(r.slo_met for r in cliff) / len(cliff), 4) if cliff else float("nan"),
        "slo_attainment": round(sum(r.slo_met for r in recs) / len(recs), 4) if recs else float("nan"),
        "agent_cold_starts": run.cold_starts,
        "spike_variant_first_load_s": round(first_load - t0, 3),
        "spike_first_query_s": round(first_query - t0, 3),
        "prewarm_events": len(prewarms),
        "spike_edge_placements": [{"t_s": round(float(e.get("ts", t0)) - t0, 2), "variant": e.get("variant_id"),
                                   "action": e.get("action"), "reason": e.get("reason")}
                                  for e in spike_loads][:8],
    }


async def run_coldstart(ctx: RunContext) -> Path:
    topo = load_topology_file(TOPOLOGY)
    sites = QUICK_SITES if ctx.quick else None
    edges = tuple(sorted(n for n in (sites or topo.sites) if topo.sites[n].tier == "edge"))
    x, y = holdout()
    trace = make_trace(geo_spec(ctx.quick, edges), len(x))
    runs: list[SystemRun] = []
    with tempfile.TemporaryDirectory(prefix="tiermesh-cold-") as tmp:
        prebuilt = Path(tmp) / "prebuilt"
        await prebuild_home_async(prebuilt)
        for name, proactive in MODES:
            t0 = time.perf_counter()
            runs.append(await run_system(name, mode="tiermesh", proactive=proactive, trace=trace, x=x, y=y,
                                         prebuilt=prebuilt, workdir=Path(tmp), sites=sites))
            print(f"   coldstart {name}: {len(runs[-1].records)} queries in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    rows = [coldstart_row(r, trace) for r in runs]
    pro, rea = rows
    # with no reactive cold-start violations the scenario did not discriminate: not measured
    ratio = (pro["cold_start_violations"] / rea["cold_start_violations"]
             if rea["cold_start_violations"] else float("nan"))
    targets = [
        target("cold-start SLO violations, proactive / reactive", ratio, 0.5, op="<=", unit="x"),
        target("spike attainment, proactive minus reactive",
               float(pro["spike_attainment"]) - float(rea["spike_attainment"]), 0.0, op=">="),
    ]
    groups = [r["mode"] for r in rows]
    plot_panels(ctx.results_dir / "coldstart.png", "Cold start: proactive vs reactive placement (same spike trace)", [
        Panel("cold-start SLO violations", "queries", groups,
              {"all": [float(r["cold_start_violations"]) for r in rows],
               "spike class at spike edge": [float(r["cold_start_violations_spike"]) for r in rows]},
              bar_text={"all": [str(r["cold_start_violations"]) for r in rows]}),
        Panel("SLO attainment", "%", groups,
              {"spike class": [100 * float(r["spike_attainment"]) for r in rows],
               "cliff": [100 * float(r["cliff_attainment"]) for r in rows],
               "all": [100 * float(r["slo_attainment"]) for r in rows]})])
    sp = trace.spec.spike
    assert sp is not None
    notes = (f"Same trace as geo ({len(trace.events)} queries, {trace.spec.duration_s:.0f} s). Spike: "
             f"{sp.slo_class} at {sp.edge}, ramp {sp.ramp_start_s:.1f}-{sp.cliff_s:.1f} s up to "
             f"{sp.ramp_qps:g} qps, cliff {sp.cliff_qps:g} qps until {sp.spike_end_s:.1f} s. Cold-start SLO "
             "violation = SLO missed and served by a variant not loaded at its site when sent (reply reason "
             "cold_start, or the agent log's first load of that pair completed after the send). Ratio: "
             f"{pro['cold_start_violations']} / {rea['cold_start_violations']}.")
    return write_result(ctx, "coldstart", rows, targets, notes=notes)


def run(quick: bool) -> dict[str, Any]:
    """Run the cold-start benchmark; returns the result document it wrote."""
    ctx = RunContext(quick=quick, command="python -m bench.coldstart" + (" --quick" if quick else ""))
    path = asyncio.run(run_coldstart(ctx))
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


if __name__ == "__main__":
    import sys

    result = run("--quick" in sys.argv[1:])
    for row in result["rows"]:
        print({k: v for k, v in row.items() if k != "spike_edge_placements"})
        for e in row["spike_edge_placements"]:
            print("   ", e)
    for t in result["targets"]:
        print(("MET " if t["met"] else "MISS") + f"  {t['name']}: {t['measured']} {t['op']} {t['target']}")
