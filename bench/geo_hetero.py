"""Geo benchmark, second edition: sites that really differ, both families, three tenants, a flash crowd.

Beside ``geo`` (same harness, same metrics: :func:`bench.geo.system_row`), on the heterogeneous testbed
``examples/topology-hetero.yaml`` run with caps (:mod:`tiermesh.caps`): every agent in a CPU cgroup of its
share of this machine (edges about a tenth of a core) with its declared model memory (an edge holds its
digits variants and at most one INT8 MiniLM encoder, never the FP32 one). Each capped site profiles its variants itself
before the trace starts (its hardware class is its own).

The trace (``bench.traces``): one compressed diurnal day at three edges, five SLO classes of three tenants:
public digits (tight 10 ms / >= 0.90, balanced 60 ms / >= 0.97, accurate 400 ms / >= 0.985), acme's topic
classification of package descriptions at >= 0.75 (only the six-layer encoders meet it: the edges cannot
hold them) and globex's coarse grouping at >= 0.83 (any encoder meets it). At mid-day a flash crowd of
globex queries hits ``edge-par-1`` (a ramp, then a cliff held for tens of seconds) beyond what its capped
CPU can compute. Every system (tiermesh, edge-only, core-only, static, INFaaS-style) replays the same trace
on a fresh mesh from one prebuilt catalog; each result row also carries the attainment at the flash-crowd
edge during the cliff, and the caps every site ran under.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import REPO_ROOT, RunContext, target, write_result
from bench.geo import (
    SYSTEMS,
    SystemRun,
    headline_targets,
    holdout,
    plot_geo,
    prebuild_home_async,
    run_system,
    system_row,
)
from bench.traces import Spike, Trace, TraceSpec, make_trace
from tiermesh.workload import SloClass
from topology.loader import load_topology_file

__all__ = ["CLASSES", "FLASH_EDGE", "TOPOLOGY", "flash_window", "hetero_spec", "run_geo_hetero"]

TOPOLOGY = REPO_ROOT / "examples" / "topology-hetero.yaml"
FLASH_EDGE = "edge-par-1"
CLASSES: tuple[SloClass, ...] = (
    SloClass("tight", latency_ms=10, min_accuracy=0.90, share=0.30),
    SloClass("balanced", latency_ms=60, min_accuracy=0.97, share=0.20),
    SloClass("accurate", latency_ms=400, min_accuracy=0.985, share=0.15),
    # 0.75: the six-layer encoders only (FP32 77.2 %, INT8 78.2 %; two and three layers 66.7-68.9 %)
    SloClass("acme-topic", latency_ms=300, min_accuracy=0.75, share=0.15, tenant="acme", task="text-topic"),
    # 0.83: every encoder (83.8-87.0 %), so an edge can serve it with the small encoder it holds
    SloClass("globex-group", latency_ms=150, min_accuracy=0.83, share=0.20, tenant="globex", task="text-group"),
)


def hetero_spec(quick: bool) -> TraceSpec:
    day = 40.0 if quick else 120.0
    hold = 15.0 if quick else 40.0
    cliff = 0.45 * day
    spike = Spike(edge=FLASH_EDGE, slo_class="globex-group", ramp_start_s=cliff - 0.1 * day, cliff_s=cliff,
                  spike_end_s=cliff + hold, ramp_qps=20.0, cliff_qps=80.0 if quick else 100.0)
    return TraceSpec(edges=("edge-fra-1", "edge-nyc-1", FLASH_EDGE), duration_s=day, day_s=day, base_qps=2.0,
                     peak_qps=8.0, spike=spike, classes=CLASSES, seed=14, max_events=8000 if quick else 20_000)


def flash_window(spec: TraceSpec) -> tuple[float, float]:
    assert spec.spike is not None
    return spec.spike.cliff_s, spec.spike.spike_end_s


def _text_data() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from variant_store.families.text_corpus import Corpus, load_corpus

    x, y = load_corpus().holdout()
    return {"text-topic": (x, y), "text-group": (x, Corpus.group_of(y))}


def flash_row(run: SystemRun, window: tuple[float, float]) -> dict[str, Any]:
    """Attainment of every query that arrived at the flash-crowd edge during the cliff."""
    rs = [r for r in run.records if r.event.edge == FLASH_EDGE and window[0] <= r.event.t < window[1]]
    met = sum(1 for r in rs if r.slo_met)
    return {"flash_queries": len(rs), "flash_slo_met": met,
            "flash_attainment": round(met / len(rs), 4) if rs else float("nan")}


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["system"]: r for r in rows}
    tm = by["tiermesh"]
    out, best, base = headline_targets(rows, infaas_ratio=1.6)
    good = [r for r in base if r["slo_attainment"] >= 0.95]
    # none at 95 %: against the strongest baseline (most SLO-met queries), not the cheapest of all: a baseline
    # that answers only the easy queries is cheap per answer and says nothing about the cost of meeting the SLOs
    ref_row = min(good, key=lambda r: r["resource_s_per_1k"]) if good else best
    ref = ref_row["resource_s_per_1k"]
    out.append(target(f"tiermesh resource-s per 1k / the cheapest baseline at >= 95 % attainment "
                      f"({ref_row['system']}{'' if good else '; none reached 95 %: the strongest baseline'})",
                      tm["resource_s_per_1k"] / ref if ref > 0 else float("nan"), 1.0, op="<=", unit="x"))
    out.append(target(f"tiermesh attainment at {FLASH_EDGE} during the flash crowd", tm["flash_attainment"], 0.95,
                      op=">="))
    if "edge-only" in by:
        out.append(target(f"edge-only attainment at {FLASH_EDGE} during the flash crowd (below 0.90)",
                          by["edge-only"]["flash_attainment"], 0.8999, op="<="))
    return out


async def run_geo_hetero(ctx: RunContext, systems: tuple[str, ...] = SYSTEMS) -> Path:
    topo = load_topology_file(TOPOLOGY)
    x, y = holdout()
    data = _text_data()
    spec = hetero_spec(ctx.quick)
    trace: Trace = make_trace(spec, max(len(x), len(data["text-topic"][0])))
    window = flash_window(spec)
    runs: list[SystemRun] = []
    with tempfile.TemporaryDirectory(prefix="tiermesh-geo-hetero-") as tmp:
        prebuilt = Path(tmp) / "prebuilt"
        build_s = await prebuild_home_async(prebuilt, TOPOLOGY, text=True)
        for name in systems:
            t0 = time.perf_counter()
            runs.append(await run_system(name, mode=name, proactive=True, trace=trace, x=x, y=y, prebuilt=prebuilt,
                                         workdir=Path(tmp), sites=None, topology=TOPOLOGY, placed_timeout_s=60.0,
                                         options={"caps": True}, data=data))
            print(f"   geo_hetero {name}: {len(runs[-1].records)} queries in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    rows = [{**system_row(r, topo), **flash_row(r, window)} for r in runs]
    targets = _targets(rows) if "tiermesh" in systems and len(rows) > 1 else []
    plot_geo(ctx.results_dir / "geo_hetero.png", rows, runs, "tiermesh vs baselines, heterogeneous sites")
    caps = runs[0].caps if runs else {}
    sp = spec.spike
    assert sp is not None
    notes = (f"{len(trace.events)} queries over {spec.duration_s:.0f} s (one compressed day) at edges "
             f"{', '.join(spec.edges)} of {TOPOLOGY.name}; diurnal {spec.base_qps:g}-{spec.peak_qps:g} qps per edge; "
             f"flash crowd: {sp.slo_class} at {sp.edge}, ramp to {sp.ramp_qps:g} qps from {sp.ramp_start_s:.0f} s, "
             f"{sp.cliff_qps:g} qps from {sp.cliff_s:.0f} s to {sp.spike_end_s:.0f} s (the 'flash_' columns: every "
             "query at that edge in that window); classes "
             + ", ".join(f"{c.name} ({c.task}, {c.latency_ms:g} ms, >= {c.min_accuracy}, {c.tenant})" for c in CLASSES)
             + f". Caps: {'cgroup CPU quotas, model-memory budgets' if caps.get('capped') else caps.get('why')}"
             f" (see 'caps'). Catalog (digits + text) built once ({build_s:.1f} s), each system on a fresh mesh; "
             "capped sites profile their variants before the trace. Resource-s = reported compute x 1 slot.")
    return write_result(ctx, "geo_hetero", rows, targets, notes=notes, extra={
        "caps": caps, "trace": {"events": len(trace.events), "seed": spec.seed, "duration_s": spec.duration_s,
                                "edges": list(spec.edges), "flash_window_s": list(window)}})

