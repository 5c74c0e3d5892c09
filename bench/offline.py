"""Offline jobs on the mesh's idle capacity (issue 32): does a job cost the online queries their SLOs, does it finish
by its deadline, and what does it cost against sending the same rows as online queries?

``geo_hetero``'s capped testbed (``examples/topology-hetero.yaml``, every agent in a CPU cgroup of its share of
this machine, edges about a tenth of a core) and its compressed diurnal trace with the flash crowd
(:func:`bench.geo_hetero.hetero_spec`: digits and text classes of three tenants at three edges) are replayed three
times in this process, each on a fresh mesh from one prebuilt catalog: ``online only``, ``online + job`` and
``online only (again)`` (the mean of the two without is the baseline; their spread is the mesh-to-mesh noise a
ratio near 1 must be read against). In ``online + job`` tenant ``acme`` submits a digits job through the SDK at the
trace's start (rows drawn with replacement from the held-out digits, labels kept; floor ``JOB_FLOOR``; deadline the
trace's length) and its progress is read from etcd every half second.

Cost, one price x compute model for both (the one :func:`bench.geo.system_row` prices online queries with): a site's
``price_per_hour`` spread over its ``cpu_cores``, times compute seconds.

- the job: each committed chunk's measured compute (the worker times its runtime's ``infer`` calls and logs it with
  the chunk: ``chunk_done``'s ``compute_ms``), priced at the site that ran it;
- the online alternative: after the trace, on the ``online only`` mesh, ``PROBE`` of the job's rows are sent one at
  a time as online queries of the same tenant with the same accuracy floor and a loose budget (1 s: the job's rows
  are not latency-bound, so routing is free to pick the cheapest candidate); each reply's own ``compute_ms`` at the
  site that served it, averaged per row and scaled to the job's rows. One at a time, so no reply's compute is a
  batch shared with others (a batched reply reports its whole batch's compute). Most of the difference is the
  batch: a chunk runs 256 rows per runtime call, an online query one. The JSON's ``job`` also carries
  ``online_batched_bound_usd``: the served variants' catalog profiles at the online batcher's largest batch (32),
  every query in a full batch. Profiles are timed in a tight loop without the executor hop that both measured
  figures include, so that bound is not like for like; it is there to show the size of the batching effect.

Attainment is also split at the job's window (submission to its last commit) per run and per edge, since a miss
outside that window cannot be the job's chunks (the door's upload of the input falls inside it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RunContext, target, write_result
from bench.geo import holdout, prebuild_home_async
from bench.geo_hetero import TOPOLOGY, hetero_spec
from bench.traces import Replayed, Trace, make_trace, replay
from core_scheduler.state.jobs import JobBook
from mesh.client import AsyncClient
from mesh.errors import MeshError
from mesh.etcd.keys import live_key
from mesh.jobs import AsyncJobs
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions, site_log
from topology.loader import load_topology_file
from topology.schema import Topology
from variant_store.catalog import Catalog
from variant_store.meta import VariantMeta

__all__ = ["run_offline"]

TASK = "digit-classification"
JOB_FLOOR = 0.95
JOB_TENANT, JOB_EDGE = "acme", "edge-fra-1"
PROBE_BUDGET_MS = 1000.0


@dataclass(slots=True)
class MeshRun:
    name: str
    records: list[Replayed]
    caps: dict[str, Any]
    progress: list[tuple[float, int]] = field(default_factory=list)   # (s into the trace, rows done)
    job: dict[str, Any] = field(default_factory=dict)
    chunks: list[dict[str, Any]] = field(default_factory=list)        # the job's chunk_done log records
    probe: list[dict[str, Any]] = field(default_factory=list)         # online queries of the job's rows
    metas: dict[str, VariantMeta] = field(default_factory=dict)       # the task's catalog, by variant id
    classes: dict[str, str | None] = field(default_factory=dict)      # site -> the hardware class it runs as


def _text_data() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The text classes' rows, as ``geo_hetero`` replays them."""
    from variant_store.families.text_corpus import Corpus, load_corpus

    x, y = load_corpus().holdout()
    return {"text-topic": (x, y), "text-group": (x, Corpus.group_of(y))}


def _price_per_core_s(topo: Topology, site: str) -> float:
    hw = topo.sites[site].hardware
    return hw.price_per_hour / 3600.0 / max(1, hw.cpu_cores)


def _chunk_logs(home: Path, sites: list[str], job_id: str) -> list[dict[str, Any]]:
    out = []
    for site in sites:
        try:
            lines = site_log(home, site).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if '"chunk_done"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == "chunk_done" and rec.get("job") == job_id:
                out.append(rec)
    return out


async def _probe(url: str, rows: np.ndarray) -> list[dict[str, Any]]:
    """Each row as one online query, one at a time (see the module docstring)."""
    out = []
    async with AsyncClient(url, tenant=JOB_TENANT, timeout=10.0) as client:
        for row in rows:
            try:
                res = await client.infer(TASK, row[None, :], latency_ms=PROBE_BUDGET_MS, min_accuracy=JOB_FLOOR)
            except MeshError as exc:
                out.append({"ok": False, "error": exc.code})
                continue
            out.append({"ok": True, "site": res.site, "variant": res.variant, "compute_ms": res.timing.compute_ms,
                        "accuracy": res.accuracy, "best_effort": res.best_effort, "total_ms": res.timing.total_ms})
    return out


async def _follow(book: JobBook, job_id: str, t0: float, until: asyncio.Task[list[Replayed]], deadline_s: float,
                  progress: list[tuple[float, int]]) -> None:
    """Progress every 0.5 s while the trace runs, then until the job is done or past its deadline (+ 10 %)."""
    while True:
        v = await book.view(job_id)
        now = time.perf_counter() - t0
        if v is not None:
            progress.append((round(now, 2), v.rows_done))
            if v.job.terminal and until.done():
                return
        if until.done() and now > 1.1 * deadline_s:
            return
        await asyncio.sleep(0.5)


async def _run_mesh(name: str, trace: Trace, prebuilt: Path, workdir: Path, *, job_rows: np.ndarray | None,
                    deadline_s: float, probe_rows: np.ndarray | None) -> MeshRun:
    x, y = holdout()
    data = _text_data()
    home = workdir / name.replace(" ", "-")
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(prebuilt, home)
    opts = MeshOptions(topology=TOPOLOGY, home=home, mode="tiermesh", proactive=True, agent_log_level="INFO",
                       caps=True, agent_env={"TIERMESH_LOG_FORMAT": "json"})  # chunk_done records as JSON lines
    async with LocalMesh(opts) as mesh:
        await mesh.wait_live()
        await mesh.wait_profiled(timeout=180.0)
        await mesh.wait_placed(timeout=60.0)
        edges = mesh.edge_urls()
        run = MeshRun(name, [], mesh.caps_report())
        t0 = time.perf_counter()
        trace_task = asyncio.create_task(replay(trace, edges, x, y, data=data))
        try:
            if job_rows is not None:
                assert mesh.store is not None
                async with AsyncJobs(edges[JOB_EDGE], tenant=JOB_TENANT) as jobs:
                    job = await jobs.submit(TASK, job_rows, min_accuracy=JOB_FLOOR, deadline_s=deadline_s)
                    submitted = time.perf_counter() - t0
                    await _follow(JobBook(mesh.store), job.id, t0, trace_task, deadline_s, run.progress)
                    status = await job.status()
                    done_at = next((t for t, n in run.progress if n >= len(job_rows)), None)
                    run.job = {"id": job.id, "rows": len(job_rows), "variant": job.admitted.get("variant"),
                               "state": status["state"], "rows_done": status["rows_done"], "sites": status["sites"],
                               "submitted_s": round(submitted, 2), "done_s": done_at, "deadline_s": deadline_s,
                               "admitted_estimate": {k: job.admitted.get(k) for k in ("estimate_s", "cost", "site")}}
                    if status["state"] == "done":
                        run.job["outputs"] = (await job.result())["logits"]
            run.records = await trace_task
        finally:
            if not trace_task.done():
                trace_task.cancel()
                await asyncio.gather(trace_task, return_exceptions=True)
        if probe_rows is not None:
            run.probe = await _probe(edges[JOB_EDGE], probe_rows)
            assert mesh.store is not None
            run.metas = {m.variant_id: m for m in await Catalog(mesh.store).list_variants(TASK)}
            for site in mesh.sites:
                live = await mesh.store.get(live_key(site))
                run.classes[site] = live.value.get("hardware_class") if live is not None else None
        if run.job:
            await asyncio.sleep(1.0)  # the last chunk's log line flushed
            run.chunks = _chunk_logs(home, list(mesh.sites), run.job["id"])
    return run


def _attainment(records: list[Replayed]) -> float:
    return sum(1 for r in records if r.slo_met) / len(records) if records else float("nan")


def _online_row(run: MeshRun, job_window: tuple[float, float]) -> dict[str, Any]:
    """Attainment overall, by class, and split at the job's window (submission to its last commit) by edge: what
    the job could have touched, and what it could not (every run is split at the same trace times)."""
    recs = run.records
    lo, hi = job_window
    inside = [r for r in recs if lo <= r.event.t <= hi]
    per_class = {c: round(_attainment([r for r in recs if r.event.slo_class == c]), 4)
                 for c in sorted({r.event.slo_class for r in recs})}
    per_edge = {e: round(_attainment([r for r in inside if r.event.edge == e]), 4)
                for e in sorted({r.event.edge for r in inside})}
    lat = [r.total_ms for r in recs if r.ok]
    return {"run": run.name, "queries": len(recs), "slo_met": sum(1 for r in recs if r.slo_met),
            "slo_attainment": round(_attainment(recs), 4), "attainment_by_class": per_class,
            "queries_in_job_window": len(inside), "attainment_in_job_window": round(_attainment(inside), 4),
            "in_job_window_by_edge": per_edge,
            "attainment_outside_job_window": round(_attainment([r for r in recs if not lo <= r.event.t <= hi]), 4),
            "errors": dict(Counter(r.error for r in recs if not r.ok)),
            "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat else float("nan")}


def _costs(topo: Topology, job: MeshRun, base: MeshRun, batched_bound: float) -> dict[str, Any]:
    rows = int(job.job["rows"])
    job_usd = sum(float(c["compute_ms"]) / 1000.0 * _price_per_core_s(topo, c["site"]) for c in job.chunks)
    job_compute_s = sum(float(c["compute_ms"]) for c in job.chunks) / 1000.0
    ok = [p for p in base.probe if p["ok"]]
    probe_usd = sum(p["compute_ms"] / 1000.0 * _price_per_core_s(topo, p["site"]) for p in ok)
    online_usd = probe_usd / len(ok) * rows if ok else float("nan")
    by_site: dict[str, int] = {}
    for c in job.chunks:
        by_site[c["site"]] = by_site.get(c["site"], 0) + int(c["rows"])
    served: dict[str, int] = {}
    for p in ok:
        key = f"{p['site']}/{p['variant']}"
        served[key] = served.get(key, 0) + 1
    return {"job_usd": float(f"{job_usd:.4g}"), "job_compute_s": round(job_compute_s, 3),
            "job_rows_committed": sum(int(c["rows"]) for c in job.chunks), "job_rows_by_site": by_site,
            "online_usd": float(f"{online_usd:.4g}"), "online_probe_queries": len(base.probe),
            "online_probe_answered": len(ok), "online_probe_served_by": served,
            "online_probe_compute_ms_mean": round(float(np.mean([p["compute_ms"] for p in ok])), 3) if ok else None,
            "online_probe_best_effort": sum(1 for p in ok if p["best_effort"]),
            "online_batched_bound_usd": float(f"{batched_bound * rows:.4g}"),
            "job_over_online": job_usd / online_usd if online_usd > 0 else float("nan"),
            "job_over_batched_bound": job_usd / (batched_bound * rows) if batched_bound > 0 else float("nan")}


def _batched_bound(run: MeshRun, topo: Topology, max_batch: int = 32) -> float:
    """USD per row of the variants the probe was served by, at the sites that served them, at the online batcher's
    largest batch (each variant's profile on that site's hardware class, else its slowest), weighted as served."""
    total, n = 0.0, 0
    for p in run.probe:
        meta = run.metas.get(p.get("variant", "")) if p["ok"] else None
        if meta is None or not meta.profiles:
            continue
        cls = run.classes.get(p["site"])
        profs = [meta.profiles[cls]] if cls in meta.profiles else list(meta.profiles.values())
        per_row = [q.compute_ms(max_batch) / max_batch for q in profs if q.latency]
        if not per_row:
            continue
        total += max(per_row) / 1000.0 * _price_per_core_s(topo, p["site"])
        n += 1
    return total / n if n else float("nan")


def _plot(path: Path, bases: list[MeshRun], job: MeshRun, day_s: float, bin_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = np.arange(0.0, day_s + bin_s, bin_s)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for run, colour in [*((b, c) for b, c in zip(bases, ("tab:gray", "tab:olive"), strict=False)), (job, "tab:green")]:
        t = np.array([r.event.t for r in run.records])
        met = np.array([r.slo_met for r in run.records], dtype=float)
        att = [float(met[(t >= lo) & (t < hi)].mean()) * 100 if ((t >= lo) & (t < hi)).any() else np.nan
               for lo, hi in itertools.pairwise(edges)]
        a1.step(edges[:-1], att, where="post", label=f"{run.name} ({_attainment(run.records) * 100:.1f} %)",
                color=colour)
        counts = [int(((t >= lo) & (t < hi)).sum()) / bin_s for lo, hi in itertools.pairwise(edges)]
        a2.plot(edges[:-1] + bin_s / 2, counts, color=colour, alpha=0.4, linestyle=":")
    a1.set_ylabel("online SLO attainment (%)")
    a1.set_ylim(min(80.0, a1.get_ylim()[0]), 101)
    a1.legend(fontsize=8, loc="lower left")
    a1.grid(alpha=0.3)
    a2.set_ylabel("online queries/s (dotted)")
    a3 = a2.twinx()
    if job.progress:
        rows = max(1, int(job.job.get("rows", 1)))
        a3.plot([t for t, _ in job.progress], [100 * n / rows for _, n in job.progress], color="tab:blue",
                label="job rows done (%)")
        a3.axvline(float(job.job["deadline_s"]), color="tab:red", linestyle="--", label="job deadline")
        if job.job.get("done_s") is not None:
            a1.axvspan(0.0, float(job.job["done_s"]), color="tab:blue", alpha=0.08)  # the job's window
        a3.legend(fontsize=8, loc="center right")
    a3.set_ylabel("job progress (%)")
    a3.set_ylim(0, 105)
    a2.set_xlabel("seconds into the compressed day")
    fig.suptitle("Online attainment with and without an offline job, and the job's progress")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


async def run_offline(ctx: RunContext) -> Path:
    topo = load_topology_file(TOPOLOGY)
    x, y = holdout()
    spec = hetero_spec(ctx.quick)
    trace = make_trace(spec, max(len(x), len(_text_data()["text-topic"][0])))
    rows = ctx.pick(30_000, 100_000)
    rng = np.random.default_rng(32)
    idx = rng.integers(0, len(x), rows)
    job_x, job_y = np.ascontiguousarray(x[idx]), y[idx]
    probe = job_x[: ctx.pick(150, 500)]
    deadline_s = spec.duration_s
    with tempfile.TemporaryDirectory(prefix="tiermesh-offline-") as tmp:
        prebuilt = Path(tmp) / "prebuilt"
        build_s = await prebuild_home_async(prebuilt, TOPOLOGY, text=True)
        runs: list[MeshRun] = []
        # the job's run between two without: their mean is the baseline, their spread the mesh-to-mesh noise
        for name, job_rows, probe_rows in (("online only", None, probe), ("online + job", job_x, None),
                                           ("online only (again)", None, None)):
            t0 = time.perf_counter()
            runs.append(await _run_mesh(name, trace, prebuilt, Path(tmp), job_rows=job_rows, deadline_s=deadline_s,
                                        probe_rows=probe_rows))
            print(f"   offline: {name}, {len(runs[-1].records)} queries in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    base, with_job, again = runs
    bound = _batched_bound(base, topo)
    outputs = with_job.job.pop("outputs", None)
    job_acc = float((outputs.argmax(1) == job_y).mean()) if outputs is not None and len(outputs) == rows else None
    costs = _costs(topo, with_job, base, bound)
    att_base = (_attainment(base.records) + _attainment(again.records)) / 2
    att_job = _attainment(with_job.records)
    done_s = with_job.job.get("done_s")
    job_cols = {"job_rows": rows, "job_state": with_job.job.get("state"), "job_variant": with_job.job.get("variant"),
                "job_done_s": done_s, "job_deadline_s": deadline_s, "job_accuracy": job_acc,
                "job_rows_by_site": costs["job_rows_by_site"], "job_usd": costs["job_usd"],
                "online_alt_usd": costs["online_usd"]}
    window = (0.0, float(done_s) if done_s is not None else spec.duration_s)
    rows_out = [_online_row(base, window), {**_online_row(with_job, window), **job_cols}, _online_row(again, window)]
    ratio_att = att_job / att_base if att_base > 0 else float("nan")
    targets = [
        target("online SLO attainment with the job / without (same trace; mean of the two runs without)", ratio_att,
               0.99, op=">=", unit="x"),
        target("job finished before its deadline (finish s / deadline s)",
               float(done_s) / deadline_s if done_s is not None else float("nan"), 1.0, op="<=", unit="x"),
        target("job cost / the same rows as online queries at the same floor (price x compute)",
               costs["job_over_online"], 0.5, op="<=", unit="x"),
    ]
    bin_s = spec.duration_s / 20
    _plot(ctx.results_dir / "offline.png", [base, again], with_job, spec.duration_s, bin_s)
    caps = base.caps
    notes = (f"geo_hetero's capped testbed ({TOPOLOGY.name}; caps: "
             f"{'cgroup CPU quotas' if caps.get('capped') else caps.get('why')}) and trace: {len(trace.events)} "
             f"queries over {spec.duration_s:.0f} s (one compressed day, flash crowd included), replayed three times "
             f"in this process on fresh meshes from one catalog (built in {build_s:.1f} s): 'online only', 'online + "
             f"job', 'online only (again)' (baseline: the mean of the two without): {rows} digits rows (held-out "
             f"rows drawn with replacement) submitted by {JOB_TENANT} at "
             f"{JOB_EDGE} at the trace's start, floor {JOB_FLOOR}, deadline {deadline_s:.0f} s (the trace's length). "
             f"Cost = price per core-second x compute seconds, both ways: the job's from each committed chunk's timed "
             f"runtime calls at its site; the online alternative's from {len(probe)} of the job's rows sent one at a "
             f"time as online queries ({JOB_TENANT}, floor {JOB_FLOOR}, budget {PROBE_BUDGET_MS:.0f} ms) after the "
             f"'online only' trace, each reply's compute at the site that served it, per row x {rows}. "
             "'job_window': submission to the last chunk's commit (same trace times in every run).")
    return write_result(ctx, "offline", rows_out, targets, notes=notes, extra={
        "caps": caps, "job": {**with_job.job, "job_accuracy": job_acc, **costs},
        "progress": with_job.progress, "chunks": with_job.chunks,
        "trace": {"events": len(trace.events), "seed": spec.seed, "duration_s": spec.duration_s}})


def run(quick: bool) -> dict[str, Any]:
    from bench.common import run_standalone

    return run_standalone("offline", quick, run_offline)


if __name__ == "__main__":
    import sys

    print(json.dumps(run("--quick" in sys.argv)["targets"], indent=1))
