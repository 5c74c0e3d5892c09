"""Shared backbones: N tenants, each with its own head, served three ways at the same offered load.

* ``copies``: every tenant holds a full model (backbone + its head in one ONNX graph), own batcher;
* ``shared``: one backbone session shared by all tenants, each tenant its own batcher (backbone then
  head per tenant batch: what a site did before cross-tenant batching);
* ``shared+batching``: ``edge_agent.host.VariantHost`` as it serves heads now: one backbone instance,
  one ``BackboneBatcher`` whose batches span tenants, each head run once per batch over its rows; one batch
  at a time on the host's ``THREADS`` intra-op threads (the first two modes: one thread per session, up to
  ``THREADS`` batches at once, which is what serves them best: with two intra-op threads each, copies
  served less within the SLO in probes).

Every variant (full model or head) declares the same largest batch, ``MAX_BATCH``, and each of the
first two modes' batchers batches up to it. The backbone batcher's batch holds one such batch of
every head on it (capped at ``edge_agent.backbone.BATCH_CAP``): one run carries what the copies
would run as N separate batches. That is the sharing measured; the copies' configuration is what a
site gives any variant of that profile.

The model: the committed digits backbone is ~50 KB, so small that the ONNX Runtime session overhead
(not weights) is what each copy costs; sharing it cannot show. So this scenario trains a wider one,
for real (``bench.wide_backbone``: scikit-learn's MLP, three 2048-wide ReLU layers, on the bundled digits
set, cached under ``.tiermesh/bench-models``); its hidden layers are the backbone (x -> 2048 features),
the digits head its output layer, the parity head a logistic regression on its features. Heads alternate
between the two across tenants. Accuracies are measured on held-out rows and reported.

The hosts settle the heap after each load, as an agent's do (``mesh.heap``: what is alive then is frozen, out
of the collector's full passes; the settle is process-wide, so the unbatched mode, deployed between two hosts,
has it too).

Memory: each (mode, N) is loaded in a fresh subprocess, which runs one full batch through every tenant
(ORT allocates arenas on first run) and reports its resident-set growth over a baseline taken after
ONNX Runtime itself was initialised, next to what the host accounts. Throughput and latency: open-loop
Poisson arrivals (bounded in count and time), tenants drawn uniformly, latency from each request's
scheduled arrival; goodput = completions within the SLO per second. Throughput at the SLO: offered
rates climb a ladder (the modes taking turns, a failed step tried twice) until fewer than 99 % of
requests finish within the SLO; a step the generator
could not offer (95 % of its schedule's rate) ends the climb and marks the result a lower bound.

Two SLOs, a ladder each: ``TIGHT_SLO_S`` (20 ms, the mesh's tight class: ``edge_agent.demand`` buckets
latencies up to 25 ms as tight) and ``SLO_S`` (50 ms). A shared backbone does not reduce the FLOPs of a row;
what it saves is weight reads per row, so it pays where bigger batches run faster per row. How much that could
be is measured, not assumed: ``ceiling_rows_per_s`` holds the bare sessions' rows/s per batch size (the
backbone alone, and four full copies taken in turn; two threads, back to back, no batcher and no generator).
Its ratio of large to small batches is the most sharing could win here; the climbs show how much of it the
serving path (Python per request, the batchers' windows, the load generator on the same two cores) turns into
throughput within the SLO. The throughput target is read at the tight SLO; every ratio (tenants x SLO)
is in the JSON (``throughput_ratios``).

Latency, two ways. *Light load* (the added-p50 target): a fixed ``LIGHT_RPS`` every mode sustains with
a wide margin, so what differs is the cost of sharing per query, batch windows held included; rounds,
modes taking turns on the same schedule, medians of the rounds (see the notes ``_report`` writes).
*Half capacity*: every mode at half the copies' throughput, one cell each; queueing dominates.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    Panel,
    RunContext,
    plot_panels,
    ratio,
    target,
    write_result,
)
from bench.openloop import climb, interleaved_rounds, median_of_rounds, open_loop, wait_quiet
from bench.shared_deploy import (
    CEILING_BATCHES,
    MAX_BATCH,
    THREADS,
    WINDOW_MS,
    Deployment,
    deploy,
    measure_ceiling,
    measure_memory,
)
from bench.wide_backbone import build_models
from edge_agent.backbone import BATCH_CAP, measure_compute_ms
from edge_agent.batching import Batcher
from variant_store.runtimes import open_runtime

__all__ = ["MODES", "TENANTS", "run_shared_backbone"]

TENANTS = (2, 4, 8)
MODES = ("copies", "shared", "shared+batching")
SLO_S = 0.05
TIGHT_SLO_S = 0.02  # the mesh's tight class (edge_agent.demand: up to 25 ms)
SLOS = (TIGHT_SLO_S, SLO_S)
# throughput at the SLO: offered rates climb from LADDER_START_RPS by LADDER_STEP while ATTAINED of the
# requests finish within the SLO
LADDER_START_RPS = 500.0
LADDER_STEP = 1.3
LADDER_MAX_RPS = 60_000.0
ATTAINED = 0.99
LADDER_REFINE = 3  # bisections after the first failure: the limit is known to within 1.3 ** (1/8), ~3 %
LADDERS = 2  # climbs per mode in a full run; the best counts
# This machine is shared: before each climb, wait (bounded) for the 1-minute load average to fall
# below QUIET_LOADAVG, so that a climb measures the server rather than a neighbour's test suite.
QUIET_LOADAVG = 2.5
QUIET_WAIT_S = 120
# Latency at light load: a fixed rate far below every mode's rps_at_slo (about a fifth of the lowest
# measured here, ~500 req/s with 4 tenants); rounds of LIGHT_COUNT requests per mode, modes in turn
LIGHT_RPS = 100.0
LIGHT_COUNT = 600
LIGHT_ROUNDS = 5
CEILING_S = 1.0


# ---------------------------------------------------------------- load


def _batch_stats(bs: list[Batcher]) -> tuple[int, int]:
    return sum(b.served for b in bs), sum(b.batches for b in bs)


async def _cell_at(dep: Deployment, xs: np.ndarray, rate: float, seconds: float, seed: int,
                   slo_s: float = SLO_S) -> dict[str, Any]:
    count = max(200, int(rate * seconds))
    served0, batches0 = _batch_stats(dep.batchers)
    res = await open_loop(dep.submits, xs, rate, count, seed=seed, time_cap_s=seconds * 2 + 10.0, slo_s=slo_s)
    served1, batches1 = _batch_stats(dep.batchers)
    return {"asked_rps": round(rate, 1), **res,
            "mean_batch_rows": round((served1 - served0) / max(1, batches1 - batches0), 1)}


def _climb_cell(deps: dict[str, Deployment], xs: np.ndarray, seconds: float, seed: int,
                slo_s: float) -> Callable[[str, float, int], Awaitable[dict[str, Any]]]:
    return lambda mode, rate, turn: _cell_at(deps[mode], xs, rate, seconds, seed + turn, slo_s)


async def run_shared_backbone(ctx: RunContext) -> Path:
    from bench.common import digits_rows

    loop = asyncio.get_running_loop()
    info = await loop.run_in_executor(None, build_models)
    root = Path(info["root"])
    cache = root / "blobs"
    xs = digits_rows(512)
    profiles: dict[str, Callable[[int], float]] = {}
    for name in ("backbone", "head-digits", "head-parity", "full-digits", "full-parity"):
        rt = open_runtime("onnx", root / f"{name}.onnx", intra_op_threads=1)
        rt.load_sync()
        profiles[name] = measure_compute_ms(rt, repeats=20)
        rt.unload_sync()
    seconds = 1.0 if ctx.quick else 2.5
    await wait_quiet(QUIET_LOADAVG, ctx.pick(20, QUIET_WAIT_S))
    ceiling = await loop.run_in_executor(None, measure_ceiling, root, 0.3 if ctx.quick else CEILING_S)
    rows: list[dict[str, Any]] = []
    ladders: list[dict[str, Any]] = []
    light_rounds: list[dict[str, Any]] = []
    for n in TENANTS:
        mem = {mode: await measure_memory(mode, n, root, cache) for mode in MODES}
        deps: dict[str, Deployment] = {}
        try:
            for mode in MODES:
                deps[mode] = await deploy(mode, n, root, cache, profiles)
            # per SLO, best of LADDERS climbs: a co-tenant's burst on this shared machine only ever lowers a climb
            caps: dict[float, dict[str, tuple[float, bool]]] = {slo: {} for slo in SLOS}
            for rep in range(ctx.pick(1, LADDERS)):
                for slo in SLOS:
                    cap = caps[slo]
                    load_before = await wait_quiet(QUIET_LOADAVG, ctx.pick(20, QUIET_WAIT_S))
                    climbs = await climb(MODES, _climb_cell(deps, xs, seconds, 100 * n + rep, slo),
                                         start=LADDER_START_RPS, step=LADDER_STEP, max_rate=LADDER_MAX_RPS,
                                         attained=ATTAINED, refine=LADDER_REFINE)
                    for mode, (steps, best, capped) in climbs.items():
                        for st in steps:
                            st["loadavg_before_climb"] = load_before
                        if mode not in cap or best > cap[mode][0]:
                            cap[mode] = (best, capped)
                        ladders += [{"tenants": n, "mode": mode, "slo_ms": slo * 1000, "climb": rep, **st}
                                    for st in steps]
            cap, tight = caps[SLO_S], caps[TIGHT_SLO_S]
            light, light_load, rounds = await _light(deps, xs, ctx, seed=1000 * n)
            light_rounds += [{"tenants": n, "mode": m, "round": r, **c} for r, rd in enumerate(rounds)
                             for m, c in rd.items()]
            common = 0.5 * cap["copies"][0] if cap["copies"][0] > 0 else LADDER_START_RPS
            for j, mode in enumerate(MODES if n % 2 == 0 else MODES[::-1]):
                cell = await _cell_at(deps[mode], xs, common, seconds * 2, seed=7 * n + j)
                lt = light[mode]
                rows.append({"tenants": n, "mode": mode,
                             "rss_growth_mb": round(mem[mode]["rss_growth"] / 2**20, 2),
                             "accounted_mb": round(mem[mode]["accounted"] / 2**20, 2),
                             "rps_at_tight_slo": tight[mode][0], "tight_generator_bound": tight[mode][1],
                             "rps_at_slo": cap[mode][0], "generator_bound": cap[mode][1],
                             "light_rps": LIGHT_RPS, "light_rounds_valid": lt["rounds_valid"],
                             "light_p50_ms": lt["p50_ms"], "light_p99_ms": lt["p99_ms"],
                             "light_batch_rows": lt["mean_batch_rows"], "light_refused": lt["refused_or_failed"],
                             "light_loadavg": light_load,
                             "common_rps": round(common, 1), "common_valid": cell["valid"],
                             "common_p50_ms": cell["p50_ms"], "common_p99_ms": cell["p99_ms"],
                             "common_batch_rows": cell["mean_batch_rows"]})
        finally:
            for dep in deps.values():
                await dep.close()
    return _report(ctx, rows, {"model": info, "ceiling_rows_per_s": ceiling, "ladders": ladders,
                               "light_rounds": light_rounds})


async def _light(deps: dict[str, Deployment], xs: np.ndarray, ctx: RunContext,
                 seed: int) -> tuple[dict[str, dict[str, Any]], float, list[dict[str, dict[str, Any]]]]:
    """Every mode at LIGHT_RPS in interleaved rounds (the same schedule for every mode in a round);
    per mode the medians over the valid rounds, the load average before the rounds, the rounds."""
    load = await wait_quiet(QUIET_LOADAVG, ctx.pick(20, QUIET_WAIT_S))
    count = ctx.pick(200, LIGHT_COUNT)

    async def cell(mode: str, r: int) -> dict[str, Any]:
        return await _cell_at(deps[mode], xs, LIGHT_RPS, count / LIGHT_RPS, seed + r)

    rounds = await interleaved_rounds(MODES, ctx.pick(2, LIGHT_ROUNDS), cell)
    return median_of_rounds(rounds, ("p50_ms", "p99_ms", "mean_batch_rows")), load, rounds


def added_p50_ms(rows: list[dict[str, Any]], n: int, mode: str, base: str, rounds: int) -> float:
    """The light-load p50 of ``mode`` minus that of ``base`` at ``n`` tenants; NaN unless a majority
    of the ``rounds`` counted (the generator kept up for every mode in them)."""
    a, b = _cell(rows, n, mode), _cell(rows, n, base)
    if min(a["light_rounds_valid"], b["light_rounds_valid"]) < rounds // 2 + 1:
        return float("nan")
    return float(a["light_p50_ms"]) - float(b["light_p50_ms"])


def _cell(rows: list[dict[str, Any]], n: int, mode: str) -> dict[str, Any]:
    return next(r for r in rows if r["tenants"] == n and r["mode"] == mode)


def _report(ctx: RunContext, rows: list[dict[str, Any]], extra: dict[str, Any]) -> Path:
    info = extra["model"]
    c, s = _cell(rows, 4, "copies"), _cell(rows, 4, "shared+batching")
    mem = ratio(s["rss_growth_mb"], c["rss_growth_mb"])
    # a copies' climb ended by the generator would make any ratio meaningless: not measured then
    thr = ratio(s["rps_at_tight_slo"], c["rps_at_tight_slo"]) if not c["tight_generator_bound"] else float("nan")
    ratios = {}
    for n in TENANTS:
        cn, sn = _cell(rows, n, "copies"), _cell(rows, n, "shared+batching")
        for key, bound_key, slo in (("rps_at_tight_slo", "tight_generator_bound", TIGHT_SLO_S),
                                    ("rps_at_slo", "generator_bound", SLO_S)):
            r = ratio(sn[key], cn[key]) if not cn[bound_key] else float("nan")
            ratios[f"{n} tenants, {slo * 1000:g} ms"] = None if not np.isfinite(r) else round(r, 2)
    extra["throughput_ratios"] = ratios
    rounds = ctx.pick(2, LIGHT_ROUNDS)
    added = added_p50_ms(rows, 4, "shared+batching", "copies", rounds)
    bound = " (a lower bound: the generator ended its climb)" if s["tight_generator_bound"] else ""
    targets = [target("4 tenants: memory (RSS growth) of shared + batching / copies", mem, 0.6, unit="x"),
               target(f"4 tenants: throughput at the tight SLO ({ATTAINED:.0%} within {TIGHT_SLO_S * 1000:g} ms), "
                      f"shared + batching / copies{bound}", thr, 1.5, op=">=", unit="x"),
               target(f"4 tenants: added p50 of shared + batching over copies at a light load ({LIGHT_RPS:g} "
                      f"req/s; median of {rounds} interleaved rounds, batch window included)", added, 2.0, unit="ms")]
    groups = [str(n) for n in TENANTS]

    def series(key: str) -> dict[str, list[float]]:
        return {m: [float(_cell(rows, n, m)[key]) for n in TENANTS] for m in MODES}

    plot_panels(ctx.results_dir / "shared_backbone.png", "Shared backbone: N tenants, one head each", [
        Panel("memory (RSS growth)", "MiB", groups, series("rss_growth_mb")),
        Panel(f"throughput at a {TIGHT_SLO_S * 1000:g} ms SLO", "requests/s", groups, series("rps_at_tight_slo")),
        Panel(f"throughput at a {SLO_S * 1000:g} ms SLO", "requests/s", groups, series("rps_at_slo")),
        Panel(f"p50 at a light load ({LIGHT_RPS:g} req/s)", "ms", groups, series("light_p50_ms")),
        Panel("p99 at half the copies' throughput", "ms (log)", groups, series("common_p99_ms"), log_y=True)])
    return write_result(ctx, "shared_backbone", rows, targets, extra=extra, notes=(
        f"backbone: sklearn MLP {tuple(info['hidden'])} trained on sklearn digits, {info['params_backbone']} "
        f"parameters ({info['backbone_bytes'] / 2**20:.1f} MiB ONNX); heads: its output layer (digits, holdout "
        f"accuracy {info['accuracy_digits']}) and a logistic regression on its features (parity, "
        f"{info['accuracy_parity']}), alternating across tenants. Memory: RSS growth of a fresh process loading "
        f"the mode and running one {MAX_BATCH}-row batch per tenant (accounted_mb: what the host counts). "
        f"{THREADS} executor threads; 1 intra-op thread per session, except the shared + batching mode's backbone "
        f"({THREADS}, one batch at a time, as a site runs it); window {WINDOW_MS:g} ms, max batch "
        f"{MAX_BATCH} per variant (the shared backbone's batch: {MAX_BATCH} per head on it, up to {BATCH_CAP}); "
        f"open-loop Poisson arrivals of one-row requests, tenant drawn uniformly, SLO "
        f"{TIGHT_SLO_S * 1000:g} ms (rps_at_tight_slo, the throughput target; the mesh's tight class) or "
        f"{SLO_S * 1000:g} ms (rps_at_slo; every other column), refused up front when the batcher predicts a "
        f"miss, latency from scheduled arrival. Throughput of shared + batching / copies: "
        f"{'; '.join(f'{k}: {v}' for k, v in extra['throughput_ratios'].items())} (sharing saves weight reads, "
        f"not FLOPs: it pays where a tenant's own traffic cannot fill an efficient batch within the SLO). "
        f"{_ceiling_note(rows, extra['ceiling_rows_per_s'])} "
        f"rps_at_slo / rps_at_tight_slo: the best goodput of a ladder of offered rates ({LADDER_START_RPS:g} req/s, x"
        f"{LADDER_STEP:g} per step, {seconds_note(ctx)} each, modes taking turns, a failed step tried twice, then "
        f"{LADDER_REFINE} geometric bisections between the last rate that passed and the one that failed, so the "
        f"limit is known to within {LADDER_STEP ** (1 / 2 ** LADDER_REFINE):.3f}x; "
        f"best of {ctx.pick(1, LADDERS)} climbs, each started once the 1-minute load average of this shared "
        f"machine was below {QUIET_LOADAVG:g} or {ctx.pick(20, QUIET_WAIT_S)} s had passed: see "
        f"loadavg_before_climb) while >= {ATTAINED:.0%} finish within the SLO; "
        f"generator_bound: the in-process load generator could not offer the next step (>= 95 % of its schedule), so "
        f"the mode's real limit is higher. light_*: latency at a light load of {LIGHT_RPS:g} req/s (every "
        f"mode's rps_at_slo is several times that: queueing is small), {rounds} rounds of {ctx.pick(200, LIGHT_COUNT)} "
        f"requests per mode, modes taking turns (order reversed every other round) and offered the same "
        f"Poisson schedule in a round; light_p50_ms / light_p99_ms = the median over the rounds in which the "
        f"generator kept up (>= 95 % of its schedule) for every mode (light_rounds_valid), latency from "
        f"scheduled arrival, including any batch window the batcher held open (window {WINDOW_MS:g} ms at most; "
        f"the batchers close it when the recent gap between arrivals says no companion would come in time, "
        f"and the backbone batcher also while an inference slot is free: light_batch_rows shows how much "
        f"batching happened); light_refused: requests refused or failed in those rounds; light_loadavg: the "
        f"1-minute load average before the rounds. The added-p50 target = light_p50_ms of shared + "
        f"batching minus that of copies at 4 tenants. common_*: every mode at half the copies' rps_at_slo "
        f"(common_rps), one cell each, where queueing dominates. Steps of every ladder and every light-load "
        f"round's cells are in the JSON ('ladders', 'light_rounds')."))


def _ceiling_note(rows: list[dict[str, Any]], ceiling: dict[str, dict[str, float]]) -> str:
    """What the bare sessions can do (ceiling_rows_per_s), and how near to it the modes came."""
    top = max(CEILING_BATCHES)
    bb, cp = ceiling["backbone"], ceiling["copies x4"]
    best = {m: max(float(r["rps_at_tight_slo"]) for r in rows if r["mode"] == m) for m in MODES}
    near = ", ".join(f"{m} {best[m] / bb[str(top)]:.0%}" for m in MODES)
    return (f"ceiling_rows_per_s: rows/s of the bare ONNX Runtime sessions, {THREADS} threads running batches "
            f"back to back for {CEILING_S:g} s per size (no batcher, no generator): the backbone alone "
            f"{bb['1']:.0f} at batch 1, {bb['20']:.0f} at 20, {bb[str(top)]:.0f} at {top}; four full copies taken "
            f"in turn {cp['1']:.0f} / {cp['20']:.0f} / {cp[str(top)]:.0f}. The best throughput at the tight SLO "
            f"over all tenant counts, as a share of the backbone's ceiling at {top}: {near}.")


def seconds_note(ctx: RunContext) -> str:
    return "1 s" if ctx.quick else "2.5 s"


if __name__ == "__main__":
    from bench.common import run_standalone

    print(json.dumps(run_standalone("shared_backbone", "--quick" in sys.argv, run_shared_backbone)["targets"],
                     indent=1))
