"""Geo benchmark: SLO attainment, accuracy, latency and cost of tiermesh vs its baselines on one trace.

Every system (``tiermesh`` and the modes of ``core_scheduler.policy.baselines``) runs on the same
geo trace (``bench.traces``) through the same harness (``tiermesh.harness.LocalMesh``: real etcd,
agent processes, ZeroMQ through WAN delay proxies), one after another in the same run, each on a
fresh mesh whose home is a copy of one prebuilt catalog (the variant build and profiling is done
once per bench run, not once per system).

Metrics per system (over all offered queries of the trace):

* *SLO attainment*: share of queries answered within their budget (edge-measured
  ``timing.total_ms``) by a variant meeting their accuracy floor (not best effort);
  *violations* = offered - met (errors, late and best-effort answers all count).
* *accuracy delivered*: share of answered queries whose argmax matches the holdout label.
* *resource-seconds per 1,000 queries*: sum over answered queries of the compute time the reply
  reports (``timing.compute_ms``, the batch it rode in) x 1 slot, per 1,000 answered queries.
  A slot is a CPU core (no GPU is present here; a GPU site would count a GPU).
* *$ per 1,000 queries*: the same compute seconds priced per slot of the serving site,
  ``price_per_hour / 3600 / cpu_cores`` from the topology.
* *cold-start violations*: violations served by a variant that was not loaded at the serving
  site when the query was sent: the reply's reason is ``cold_start`` (routing saw it unloaded), or
  the agent's log shows that (site, variant) finished its first load after the send time.
* footprint at the end: variants loaded and model memory held, summed over sites (heartbeats).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import REPO_ROOT, RunContext, percentile, run_standalone, target, write_result
from bench.traces import Replayed, Spike, Trace, TraceSpec, make_trace, replay
from mesh.etcd.keys import live_key
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions, site_log
from topology.loader import load_topology_file
from topology.schema import Topology

__all__ = ["SYSTEMS", "SystemRun", "geo_spec", "prebuild_home", "run", "run_geo", "run_system", "system_row"]

TOPOLOGY = REPO_ROOT / "examples" / "topology.yaml"
QUICK_SITES = ["core-eu", "mid-eu", "edge-fra-1", "edge-sin-1"]
SYSTEMS = ("tiermesh", "edge-only", "core-only", "static", "infaas")


def geo_spec(quick: bool, edges: tuple[str, ...]) -> TraceSpec:
    """One compressed day; the spike is balanced traffic at the far edge (Singapore), where only a
    local variant better than the warm floor's can meet it. That edge's everyday traffic is tight
    only (any more accurate class would make placement load a variant that also serves the spike)."""
    day = 6.0 if quick else 50.0
    spike = Spike(edge="edge-sin-1", slo_class="balanced", ramp_start_s=0.35 * day, cliff_s=0.6 * day,
                  spike_end_s=0.8 * day, ramp_qps=4.0 if quick else 6.0, cliff_qps=12.0 if quick else 20.0)
    return TraceSpec(edges=edges, duration_s=day, day_s=day, base_qps=2.0 if quick else 3.0,
                     peak_qps=8.0 if quick else 12.0, spike=spike if "edge-sin-1" in edges else None,
                     seed=11, max_events=3000 if quick else 12_000,
                     spike_edge_classes=("tight",) if "edge-sin-1" in edges else None)


def prebuild_home(dst: Path, topology: Path = TOPOLOGY, *, text: bool = False,
                  text_backbones: list[str] | None = None) -> float:
    """Build the catalog (digits family, profiled; with ``text`` the text family too) once into ``dst``;
    returns seconds taken. Synchronous (its own event loop): call it from a thread when a loop is running."""
    from mesh.etcd.server import EmbeddedEtcd
    from mesh.etcd.store import Store
    from topology.store_io import apply as apply_topology
    from variant_store.blobs import BlobStore
    from variant_store.build import ensure_digits_family
    from variant_store.catalog import Catalog

    async def build() -> None:
        etcd = EmbeddedEtcd(dst / "etcd")
        await etcd.start()
        try:
            store = await Store.connect(etcd.url, "/tiermesh/")
            try:
                await apply_topology(store, load_topology_file(topology))
                await ensure_digits_family(Catalog(store), BlobStore(dst / "blobs"), progress=False)
                if text:
                    from variant_store.build_text import ensure_text_family

                    await ensure_text_family(Catalog(store), BlobStore(dst / "blobs"), progress=False,
                                             backbones=text_backbones)
            finally:
                await store.close()
        finally:
            await etcd.stop()

    t0 = time.perf_counter()
    dst.mkdir(parents=True, exist_ok=True)
    asyncio.run(build())
    return time.perf_counter() - t0


async def prebuild_home_async(dst: Path, topology: Path = TOPOLOGY, *, text: bool = False,
                              text_backbones: list[str] | None = None) -> float:
    """``prebuild_home`` from inside an event loop (runs it in a worker thread with its own loop)."""
    return await asyncio.to_thread(lambda: prebuild_home(dst, topology, text=text, text_backbones=text_backbones))


@contextlib.contextmanager
def _agent_json_logs() -> Iterator[None]:
    # agents inherit our environment: JSON lines carry each load's wall-clock completion time
    old = os.environ.get("TIERMESH_LOG_FORMAT")
    os.environ["TIERMESH_LOG_FORMAT"] = "json"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TIERMESH_LOG_FORMAT", None)
        else:
            os.environ["TIERMESH_LOG_FORMAT"] = old


@dataclass(slots=True)
class SystemRun:
    name: str
    records: list[Replayed]
    loads: dict[tuple[str, str], list[float]]   # (site, variant) -> wall-clock load completions
    footprint: dict[str, dict[str, Any]]        # site -> {variants, memory_mb} at the end
    startup_s: float
    cold_starts: int                             # loads the agents counted (heartbeats)
    events: list[dict[str, Any]]                 # the scheduler's placement events (with reasons)
    caps: dict[str, Any] = field(default_factory=dict)  # what each site ran under (LocalMesh.caps_report)


def _read_loads(home: Path, sites: list[str]) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = {}
    for site in sites:
        path = site_log(home, site)
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if '"event": "load"' not in line:
                    continue
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    rec = json.loads(line)
                    out.setdefault((rec["site"], rec["variant"]), []).append(float(rec["ts"]))
    return out


async def run_system(name: str, *, mode: str, proactive: bool, trace: Trace, x: np.ndarray, y: np.ndarray,
                     prebuilt: Path, workdir: Path, sites: list[str] | None, topology: Path = TOPOLOGY,
                     placed_timeout_s: float = 20.0, options: dict[str, Any] | None = None,
                     data: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> SystemRun:
    """A fresh mesh in ``mode`` (home copied from ``prebuilt``), the trace replayed, then stopped.
    ``options``: more ``MeshOptions`` (caps, ...); ``data``: other tasks' rows for the replay."""
    home = workdir / name
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(prebuilt, home)
    t0 = time.perf_counter()
    opts = MeshOptions(topology=topology, home=home, mode=mode, proactive=proactive, sites=sites,
                       agent_log_level="INFO", **(options or {}))
    with _agent_json_logs():
        async with LocalMesh(opts) as mesh:
            await mesh.wait_live()
            if opts.caps:  # capped sites time their variants themselves first (their class is new)
                await mesh.wait_profiled(timeout=180.0)
            await mesh.wait_placed(timeout=placed_timeout_s)
            startup = time.perf_counter() - t0
            records = await replay(trace, mesh.edge_urls(), x, y, data=data)
            footprint: dict[str, dict[str, Any]] = {}
            cold = 0
            assert mesh.store is not None
            for site in mesh.sites:
                kv_ = await mesh.store.get(live_key(site))
                rec = kv_.value if kv_ is not None else {}
                footprint[site] = {"variants": len(rec.get("loaded") or {}),
                                   "memory_mb": round(float(rec.get("memory_used_bytes", 0)) / 2**20, 2)}
                cold += int(rec.get("cold_starts", 0))
            events = list(mesh.scheduler.events) if mesh.scheduler is not None else []
            caps = mesh.caps_report()
    return SystemRun(name, records, _read_loads(home, list(footprint)), footprint, startup, cold, events, caps)


def cold_on_arrival(r: Replayed, loads: dict[tuple[str, str], list[float]]) -> bool:
    """Served by a variant not loaded at its site when the query was sent."""
    if not r.ok:
        return False
    if r.reason == "cold_start":
        return True
    done = loads.get((r.site, r.variant))
    return done is not None and len(done) > 0 and min(done) > r.sent_wall


def system_row(run: SystemRun, topo: Topology) -> dict[str, Any]:
    recs = run.records
    ok = [r for r in recs if r.ok]
    met = sum(1 for r in recs if r.slo_met)
    compute_s = sum(r.compute_ms for r in ok) / 1000.0
    dollars = 0.0
    for r in ok:
        hw = topo.sites[r.site].hardware if r.site in topo.sites else None
        if hw is not None:
            dollars += r.compute_ms / 1000.0 * hw.price_per_hour / 3600.0 / max(1, hw.cpu_cores)
    lat = [r.total_ms for r in ok]
    per_class: dict[str, float] = {}
    for cls in sorted({r.event.slo_class for r in recs}):
        rs = [r for r in recs if r.event.slo_class == cls]
        per_class[cls] = round(sum(1 for r in rs if r.slo_met) / len(rs), 4)
    cold_viol = sum(1 for r in recs if not r.slo_met and cold_on_arrival(r, run.loads))
    k = 1000.0 / max(1, len(ok))
    return {
        "system": run.name, "queries": len(recs), "answered": len(ok), "slo_met": met,
        "slo_attainment": round(met / len(recs), 4) if recs else float("nan"),
        "violations": len(recs) - met,
        "errors": dict(Counter(r.error for r in recs if not r.ok)),
        # where the misses are: class / tier served at (or the error code)
        "violations_by": dict(Counter(
            f"{r.event.slo_class}/{topo.sites[r.site].tier if r.ok and r.site in topo.sites else r.error}"
            + ("/best_effort" if r.best_effort else "") for r in recs if not r.slo_met).most_common(6)),
        "best_effort": sum(1 for r in ok if r.best_effort),
        "accuracy": round(sum(1 for r in ok if r.correct) / len(ok), 4) if ok else float("nan"),
        "p50_ms": round(percentile(lat, 50), 2), "p99_ms": round(percentile(lat, 99), 2),
        "resource_s_per_1k": round(compute_s * k, 5), "usd_per_1k": float(f"{dollars * k:.3g}"),
        "cold_start_violations": cold_viol, "agent_cold_starts": run.cold_starts,
        "attainment_by_class": per_class,
        "served_at_tier": dict(Counter(topo.sites[r.site].tier if r.site in topo.sites else "?" for r in ok)),
        "top_variants": dict(Counter(r.variant for r in ok).most_common(3)),
        "variants_loaded_end": sum(f["variants"] for f in run.footprint.values()),
        "model_memory_mb_end": round(sum(f["memory_mb"] for f in run.footprint.values()), 2),
        "startup_s": round(run.startup_s, 1),
    }


def plot_geo(path: Path, rows: list[dict[str, Any]], runs: list[SystemRun], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = [r["system"] for r in rows]
    att = [100 * float(r["slo_attainment"]) for r in rows]
    bars = a1.bar(names, att, color=["tab:green" if n == "tiermesh" else "tab:gray" for n in names])
    for b, v in zip(bars, att, strict=True):
        a1.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    a1.set_ylabel("SLO attainment (%)")
    a1.set_ylim(0, 105)
    a1.set_title("SLO attainment, same trace")
    a1.tick_params(axis="x", labelsize=8)
    for run in runs:
        lat = np.sort([r.total_ms for r in run.records if r.ok])
        if lat.size:
            a2.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=run.name)
    a2.set_xscale("log")
    a2.set_xlabel("edge-measured latency (ms, log)")
    a2.set_ylabel("fraction of answered queries")
    a2.set_title("Latency CDF")
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def holdout() -> tuple[np.ndarray, np.ndarray]:
    from variant_store.families.datasets import load_validation_npz

    val = load_validation_npz()
    return val.x[val.calib_count:], val.y[val.calib_count:]


def headline_targets(rows: list[dict[str, Any]], *, infaas_ratio: float
                     ) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    """The targets every geo scenario has: tiermesh meets the SLO on more queries than the best baseline,
    and INFaaS-style has ``infaas_ratio`` x its violations. Returns them, the best baseline's row and every
    baseline's row."""
    by = {r["system"]: r for r in rows}
    tm = by["tiermesh"]
    base = [r for r in rows if r["system"] != "tiermesh"]
    best = max(base, key=lambda r: r["slo_met"])
    out = [target(f"tiermesh SLO-met queries minus the best baseline's ({best['system']})",
                  float(tm["slo_met"] - best["slo_met"]), 1.0, op=">=", unit="queries")]
    if "infaas" in by:
        out.append(target("INFaaS-style violations / tiermesh violations",
                          by["infaas"]["violations"] / max(1, tm["violations"]), infaas_ratio, op=">=", unit="x"))
    return out, best, base


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tm = next(r for r in rows if r["system"] == "tiermesh")
    out, _, base = headline_targets(rows, infaas_ratio=2.0)
    good = [r for r in base if r["slo_attainment"] >= 0.95] or base
    cheapest = min(good, key=lambda r: r["resource_s_per_1k"])
    ref = cheapest["resource_s_per_1k"]
    out.append(target(f"tiermesh resource-s per 1k / least of baselines at >= 95 % attainment "
                      f"({cheapest['system']}{'' if good is not base else '; none reached 95 %: all'})",
                      tm["resource_s_per_1k"] / ref if ref > 0 else float("nan"), 1.0, op="<=", unit="x"))
    return out


async def run_geo(ctx: RunContext, systems: tuple[str, ...] = SYSTEMS) -> Path:
    topo = load_topology_file(TOPOLOGY)
    sites = QUICK_SITES if ctx.quick else None
    edges = tuple(sorted(n for n in (sites or topo.sites) if topo.sites[n].tier == "edge"))
    x, y = holdout()
    trace = make_trace(geo_spec(ctx.quick, edges), len(x))
    runs: list[SystemRun] = []
    with tempfile.TemporaryDirectory(prefix="tiermesh-geo-") as tmp:
        prebuilt = Path(tmp) / "prebuilt"
        build_s = await prebuild_home_async(prebuilt)
        for name in systems:
            t0 = time.perf_counter()
            runs.append(await run_system(name, mode=name, proactive=True, trace=trace, x=x, y=y,
                                         prebuilt=prebuilt, workdir=Path(tmp), sites=sites))
            print(f"   geo {name}: {len(runs[-1].records)} queries in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    rows = [system_row(r, topo) for r in runs]
    targets = _targets(rows) if "tiermesh" in systems and len(rows) > 1 else []
    plot_geo(ctx.results_dir / "geo.png", rows, runs, "tiermesh vs baselines on one geo trace")
    spec = trace.spec
    notes = (f"{len(trace.events)} queries over {spec.duration_s:.0f} s (one compressed day) at edges "
             f"{', '.join(edges)}; diurnal {spec.base_qps:g}-{spec.peak_qps:g} qps per edge, phases spread by "
             f"region; spike: {spec.spike.slo_class if spec.spike else '-'} at "
             f"{spec.spike.edge if spec.spike else '-'}; classes "
             + ", ".join(f"{c.name} ({c.latency_ms:g} ms, >= {c.min_accuracy}, {c.tenant}"
                         f"{', prefer ' + c.prefer if c.prefer != 'latency' else ''})" for c in spec.classes)
             + f". Sites: {', '.join(sites or sorted(topo.sites))}. Catalog built once ({build_s:.1f} s), each "
             "system on a fresh mesh. Resource-s = reported compute x 1 slot; $ = that x price per slot. "
             "2 shared cores run every agent, etcd and the load generator: tails are noisy.")
    path = write_result(ctx, "geo", rows, targets, notes=notes,
                        extra={"trace": {"events": len(trace.events), "seed": spec.seed,
                                         "duration_s": spec.duration_s, "edges": list(edges)}})
    return path


def run(quick: bool) -> dict[str, Any]:
    """Run the geo benchmark; returns the result document it wrote."""
    return run_standalone("geo", quick, run_geo)


if __name__ == "__main__":
    import sys

    result = run("--quick" in sys.argv[1:])
    for row in result["rows"]:
        print(f"{row['system']:10s} attainment {100 * row['slo_attainment']:.1f} %  acc {row['accuracy']}  "
              f"p50 {row['p50_ms']} p99 {row['p99_ms']} ms  res-s/1k {row['resource_s_per_1k']}  "
              f"$/1k {row['usd_per_1k']}  cold-viol {row['cold_start_violations']}")
    for t in result["targets"]:
        print(("MET " if t["met"] else "MISS") + f"  {t['name']}: {t['measured']} {t['op']} {t['target']}")
