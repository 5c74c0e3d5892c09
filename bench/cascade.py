"""Cascades on the capped geo mesh (issue 33, Done-when): at (about) the large variant's accuracy, how many queries
cross the WAN and what do they cost, against serving every query with the large variant, and with the small one?

The geo mesh (``examples/topology.yaml``, ``bench.geo``'s and ``make demo``'s: every agent in a CPU cgroup of its
share of this machine, edges a tenth of a core and 84-338 MiB of model memory) serves two tasks, each with the
built-in cascade its family registers (:mod:`variant_store.cascade`): digits (the smallest public INT8 variant, then
the most accurate one) and text topics (the L2 INT8 encoder's head, then the 6-layer one's). (``geo_hetero``'s
testbed gives an edge 25 MiB of models: too little for the L2 text encoder, so the text cascade's first stage never
ran at the door there.) One open-loop trace (Poisson arrivals at
three edges, each query ``ROWS[task]`` held-out rows, budget ``BUDGET_MS[task]``) is replayed in this process on a
fresh mesh per arm, all from one prebuilt catalog, each arm's catalog edited once its mesh is up (the mesh's start
re-registers a family's built-in cascade, so the edit must come after it):

- ``large only``: the task's cascades and every variant but the cascade's last stage removed from the catalog;
- ``small only``: the cascades and every variant but the cascade's first stage removed;
- ``tiermesh + cascades``: the catalog as built (cascades, every variant): routing picks, per query, the cheapest
  candidate meeting the query's floor and budget, a cascade among them;
- ``large only (again)``: the first arm again, last, so the pair's spread shows this machine's run-to-run noise.

Every arm asks the same SLO per task: its budget and the floor ``min(cascade accuracy, large accuracy)`` (the
catalog's held-out figures), so ``small only`` is answered best effort (its accuracy is below the floor) and misses
that SLO by design; ``latency_attainment`` is the share answered within budget whatever the variant.

The rows sent are the held-out half of the validation split the cascades were *not* calibrated on
(:func:`variant_store.cascade.split_rows`, the store's own seed), so each answer's accuracy is scored on rows no
threshold was fitted to. Per arm: accuracy (every answered row's argmax against its label, with its standard error),
WAN share (a query crosses the WAN when any of its answer's stages, or its answer, came from a site other than the
edge it was sent to; also counted per row), cost (price per core-second of the serving site, the topology's
``price_per_hour / cpu_cores``, x the reply's compute seconds, summed over a cascade's stages: the accounting of
:func:`bench.geo.system_row`), SLO attainment, p99 latency and, for cascades, the escalation rate (queries answered
``cascade_escalated``, and rows sent to stage 2). A reply's compute is its batch's (the batcher may merge queries):
the same accounting in every arm.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.cascade_figures import (
    ARMS,
    BUDGET_MS,
    CASCADES,
    DIGITS,
    EDGES,
    LARGE,
    LARGE_AGAIN,
    ROWS,
    TASKS,
    TEXT,
    Event,
    Outcome,
    arm_row,
    make_events,
    plot,
    targets,
)
from bench.common import RunContext, write_result
from bench.geo import TOPOLOGY, prebuild_home_async  # not geo_hetero's: see the module docstring
from bench.traces import open_loop
from mesh.client import AsyncClient, InferResult
from mesh.errors import MeshError
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions
from topology.loader import load_topology_file
from topology.schema import Topology
from variant_store.cascade import split_rows
from variant_store.cascade_meta import CascadeMeta
from variant_store.catalog import Catalog

__all__ = ["replay", "run", "run_cascade"]

MAX_INFLIGHT = 32


def _price(topo: Topology, site: str) -> float:
    hw = topo.sites[site].hardware if site in topo.sites else None
    return hw.price_per_hour / 3600.0 / max(1, hw.cpu_cores) if hw is not None else 0.0


def _record(o: Outcome, res: InferResult, labels: np.ndarray, topo: Topology) -> None:
    o.ok, o.total_ms, o.site, o.variant = True, res.timing.total_ms, res.site, res.variant
    o.reason, o.best_effort = res.reason, res.best_effort
    o.correct = int((np.asarray(res.output()).argmax(axis=1) == labels).sum())
    if res.stages:
        o.stage_sites = tuple(s.site for s in res.stages)
        o.compute_s = sum(s.compute_ms for s in res.stages) / 1000.0
        o.usd = sum(s.compute_ms / 1000.0 * _price(topo, s.site) for s in res.stages)
        o.rows_escalated = sum(s.rows for s in res.stages[1:])
        o.rows_remote = sum(s.answered for s in res.stages if s.site != o.event.edge)
    else:
        o.compute_s = res.timing.compute_ms / 1000.0
        o.usd = o.compute_s * _price(topo, res.site)
        o.rows_remote = len(o.event.rows) if res.site != o.event.edge else 0


async def replay(events: list[Event], edges: dict[str, str], data: dict[str, tuple[np.ndarray, np.ndarray]],
                 floors: dict[str, float], tenants: dict[str, str], topo: Topology, *, timeout_s: float = 10.0,
                 drain_s: float = 20.0) -> list[Outcome]:
    """Each event to its edge at its offset (open loop, at most ``MAX_INFLIGHT`` outstanding); bounded by the
    trace's length plus ``drain_s``."""
    clients = {(e, t): AsyncClient(url, tenant=t, timeout=timeout_s) for e, url in edges.items()
               for t in set(tenants.values())}
    sem = asyncio.Semaphore(MAX_INFLIGHT)
    out: list[Outcome] = []

    async def one(ev: Event) -> None:
        x, y = data[ev.task]
        idx = np.array(ev.rows)
        o = Outcome(ev, BUDGET_MS[ev.task])
        async with sem:
            try:
                res = await clients[(ev.edge, tenants[ev.task])].infer(ev.task, x[idx], latency_ms=BUDGET_MS[ev.task],
                                                   min_accuracy=floors[ev.task])
            except MeshError as exc:
                o.error = exc.code
            else:
                _record(o, res, y[idx], topo)
        out.append(o)

    try:
        await open_loop(events, one, drain_s)
    finally:
        for c in clients.values():
            await c.aclose()
    out.sort(key=lambda o: o.event.t)
    return out


# ------------------------------------------------------------------ the meshes


def _data() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each task's held-out half (rows no cascade threshold was fitted to), as (inputs, labels)."""
    from bench.geo import holdout
    from variant_store.families.text_corpus import load_corpus

    out = {}
    for task, (x, y) in ((DIGITS, holdout()), (TEXT, load_corpus().holdout())):
        y = np.asarray(y).reshape(-1).astype(np.int64)
        held = split_rows(y)[1]
        out[task] = (x[held], y[held])
    return out


def _builtin(cascades: list[CascadeMeta], task: str) -> CascadeMeta:
    """The family's built-in cascade of ``task`` (two stages; its owner's tenant asks the task's queries: the text
    family's topic heads, so its cascade, are acme's); the most accurate when there are several."""
    mine = [c for c in cascades if c.task == task and len(c.stages) == 2]
    if not mine:
        raise RuntimeError(f"no built-in cascade of {task} in the catalog: the family registered none")
    return max(mine, key=lambda c: (c.accuracy, c.cascade_id))


async def _edit(catalog: Catalog, arm: str, plans: dict[str, CascadeMeta]) -> dict[str, set[str]]:
    """Leave in the catalog what ``arm`` serves with; returns, per task, the variants its answers may name."""
    keep: dict[str, set[str]] = {}
    for task, c in plans.items():
        if arm == CASCADES:
            keep[task] = {v.variant_id for v in await catalog.list_variants(task)}
            continue
        only = c.stages[-1] if arm in (LARGE, LARGE_AGAIN) else c.stages[0]
        for other in await catalog.cascades(task):
            await catalog.remove_cascade(task, other.cascade_id)
        for v in await catalog.list_variants(task):
            if v.variant_id != only:
                await catalog.remove_variant(task, v.variant_id)
        keep[task] = {only}
    return keep


async def _settle(edges: dict[str, str], data: dict[str, tuple[np.ndarray, np.ndarray]], arm: str,
                  keep: dict[str, set[str]], floors: dict[str, float], tenants: dict[str, str],
                  timeout_s: float = 30.0) -> dict[str, Any]:
    """Probe every (edge, task) until the answers follow the arm's catalog: only its variants (a baseline), a
    cascade at least once (the cascades arm); bounded by ``timeout_s``. Returns what the last round saw."""
    deadline = time.monotonic() + timeout_s
    seen: dict[str, Any] = {}
    clients = {(e, task): AsyncClient(u, tenant=tenants[task], timeout=10.0) for e, u in edges.items()
               for task in TASKS}
    try:
        while time.monotonic() < deadline:
            good = True
            cascade_seen = False
            for (edge, task), client in clients.items():
                x, _y = data[task]
                try:
                    r = await client.infer(task, x[: ROWS[task]], latency_ms=BUDGET_MS[task],
                                           min_accuracy=floors[task])
                except MeshError as exc:
                    seen[f"{edge}/{task}"] = exc.code
                    good = False
                    continue
                seen[f"{edge}/{task}"] = f"{r.reason}@{r.site}/{r.variant}"
                good &= r.variant in keep[task]
                cascade_seen |= r.reason.startswith("cascade_")
            if good and (arm != CASCADES or cascade_seen):
                return {"settled": True, "probes": seen}
            await asyncio.sleep(1.0)
    finally:
        for c in clients.values():
            await c.aclose()
    return {"settled": False, "probes": seen}


@dataclass(slots=True)
class ArmRun:
    arm: str
    outcomes: list[Outcome] = field(default_factory=list)
    settle: dict[str, Any] = field(default_factory=dict)
    caps: dict[str, Any] = field(default_factory=dict)
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)


async def _run_arm(arm: str, events: list[Event], prebuilt: Path, workdir: Path, topo: Topology,
                   data: dict[str, tuple[np.ndarray, np.ndarray]]) -> ArmRun:
    home = workdir / arm.replace(" ", "-").replace("(", "").replace(")", "").replace("+", "plus")
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(prebuilt, home)
    opts = MeshOptions(topology=TOPOLOGY, home=home, mode="tiermesh", proactive=True, caps=True)
    run = ArmRun(arm)
    async with LocalMesh(opts) as mesh:
        await mesh.wait_live()
        await mesh.wait_profiled(timeout=180.0)
        assert mesh.catalog is not None
        cascades = await mesh.catalog.cascades()
        plans = {t: _builtin(cascades, t) for t in TASKS}
        metas = {t: {v.variant_id: v for v in await mesh.catalog.list_variants(t)} for t in TASKS}
        floors = {t: min(c.accuracy, metas[t][c.stages[-1]].accuracy) for t, c in plans.items()}
        tenants = {t: c.owner for t, c in plans.items()}
        run.plans = {t: {"cascade": c.cascade_id, "stages": list(c.stages), "thresholds": list(c.thresholds),
                         "cascade_accuracy": c.accuracy, "escalation": list(c.escalation),
                         "stage_accuracy": [metas[t][s].accuracy for s in c.stages], "floor": floors[t],
                         "tenant": tenants[t]}
                     for t, c in plans.items()}
        keep = await _edit(mesh.catalog, arm, plans)
        run.settle = await _settle(mesh.edge_urls(), data, arm, keep, floors, tenants)
        run.outcomes = await replay(events, mesh.edge_urls(), data, floors, tenants, topo)
        run.caps = mesh.caps_report()
    return run


async def run_cascade(ctx: RunContext) -> Path:
    topo = load_topology_file(TOPOLOGY)
    data = _data()
    duration = float(ctx.pick(20, 90))
    qps = 1.0 if ctx.quick else 1.5
    events = make_events(duration_s=duration, qps=qps, sizes={t: len(d[1]) for t, d in data.items()}, rows=ROWS)
    runs: list[ArmRun] = []
    with tempfile.TemporaryDirectory(prefix="tiermesh-cascade-") as tmp:
        prebuilt = Path(tmp) / "prebuilt"
        build_s = await prebuild_home_async(prebuilt, TOPOLOGY, text=True)
        for arm in ARMS:
            t0 = time.perf_counter()
            runs.append(await _run_arm(arm, events, prebuilt, Path(tmp), topo, data))
            print(f"   cascade: {arm}, {len(runs[-1].outcomes)} queries in {time.perf_counter() - t0:.1f} s "
                  f"(settled: {runs[-1].settle.get('settled')})", flush=True)
    rows = [arm_row(r.arm, task, r.outcomes) for task in TASKS for r in runs]
    tgts = targets(rows)
    plot(ctx.results_dir / "cascade.png", rows)
    plans = runs[0].plans
    notes = (f"{len(events)} queries ({qps:g} qps per edge and task for {duration:.0f} s at {', '.join(EDGES)}) of "
             f"{TOPOLOGY.name} under caps, replayed once per arm on a fresh mesh from one catalog (built in "
             f"{build_s:.1f} s): " + "; ".join(
                 f"{t}: {ROWS[t]} held-out row(s) a query, budget {BUDGET_MS[t]:g} ms, floor {p['floor']:.4f} "
                 f"(cascade {p['cascade']}: {' -> '.join(p['stages'])}, threshold "
                 f"{', '.join(f'{x:.4f}' for x in p['thresholds'])}, catalog held-out accuracy "
                 f"{p['cascade_accuracy']:.4f} vs stages {', '.join(f'{a:.4f}' for a in p['stage_accuracy'])}, "
                 f"escalation {', '.join(f'{e:.3f}' for e in p['escalation'])})" for t, p in plans.items())
             + ". 'large only' / 'small only': the cascades and every other variant of the task removed from the "
             "catalog once the arm's mesh is up; 'tiermesh + cascades': the catalog as built. Rows: the held-out half "
             "of the validation split the cascades were not calibrated on. wan_share: queries answered (in whole or "
             "part) at a site other than the door's edge; wan_row_share: the same per row. Cost: price per core-second "
             "x reported compute, summed over a cascade's stages (a batched reply reports its batch's compute). "
             "Accuracy's standard error is binomial over the rows scored; text's held-out half is small. Routing "
             "chooses a cascade only when it is the cheapest feasible candidate: 'cascade_queries' counts the answers "
             "a cascade gave; where it is 0 the cascades arm's figures are plain routing's, not a cascade's.")
    return write_result(ctx, "cascade", rows, tgts, notes=notes, extra={
        "caps": runs[0].caps if runs else {}, "plans": plans,
        "settle": {r.arm: r.settle for r in runs},
        "trace": {"events": len(events), "duration_s": duration, "qps_per_edge_task": qps, "rows": ROWS,
                  "budget_ms": BUDGET_MS}})


def run(quick: bool) -> dict[str, Any]:
    from bench.common import run_standalone

    return run_standalone("cascade", quick, run_cascade)


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run("--quick" in sys.argv)["targets"], indent=1))
