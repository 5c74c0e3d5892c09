"""Dynamic batching: throughput and tail latency with and without it, at equal offered load.

One real digits variant (the wide MLP or small CNN when committed, else a trained sklearn MLP) in
``variant_store.runtimes``' ONNX runtime behind ``edge_agent.batching.Batcher``. Arrivals are open
loop (Poisson, bounded in count and time) so a slow server cannot slow its own offered load, and
latency runs from each request's *scheduled* arrival (no coordinated omission). Loads are set
relative to the unbatched capacity measured first, in the same run.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    Panel,
    RunContext,
    closed_loop_rate,
    compute_model,
    digits_model,
    digits_rows,
    percentile,
    plot_panels,
    ratio,
    target,
    write_result,
)
from edge_agent.batching import Batcher
from mesh.errors import DeadlineExceeded, MeshError, Overloaded
from variant_store.runtimes import Runtime, open_runtime

__all__ = ["LOAD_FACTORS", "open_loop", "run_batching"]

LOAD_FACTORS = (0.5, 1.0, 2.0)  # x the unbatched capacity
SLO_S = 0.1
MAX_BATCH = 32
WINDOW_MS = 2.0


async def open_loop(batcher: Batcher, name: str, xs: np.ndarray, rate: float, n: int, *, seed: int,
                    slo_s: float = SLO_S, time_cap_s: float = 30.0) -> dict[str, Any]:
    """Offer ``n`` one-row requests as a Poisson stream of ``rate``/s; what came back, and how fast."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))
    lat: list[float] = []
    rows: list[int] = []
    counts = {"rejected": 0, "late": 0, "failed": 0}
    last_done = 0.0
    tasks: set[asyncio.Task[None]] = set()
    t0, w0 = time.perf_counter(), time.monotonic()

    async def one(i: int) -> None:
        nonlocal last_done
        try:
            res = await batcher.submit({name: xs[i % len(xs)][None, :]}, w0 + float(arrivals[i]) + slo_s)
        except Overloaded:
            counts["rejected"] += 1
            return
        except DeadlineExceeded:
            counts["late"] += 1
            return
        except MeshError:
            counts["failed"] += 1
            return
        last_done = time.perf_counter() - t0
        lat.append(last_done - float(arrivals[i]))
        rows.append(res.batch_rows)

    i = 0
    while i < n and time.perf_counter() - t0 < time_cap_s:
        now = time.perf_counter() - t0
        while i < n and arrivals[i] <= now:
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if i < n:
            await asyncio.sleep(max(0.0, float(arrivals[i]) - (time.perf_counter() - t0)))
    sent_span = time.perf_counter() - t0
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=slo_s * 10 + 5.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    ms = np.asarray(lat) * 1000.0
    return {"sent": i, "arrival_rps": round(i / sent_span, 1) if sent_span > 0 else float("nan"),
            "completed": len(lat), **counts,
            "throughput_rps": round(len(lat) / last_done, 1) if last_done > 0 else 0.0,
            "p50_ms": round(percentile(ms, 50), 2), "p99_ms": round(percentile(ms, 99), 2),
            "mean_batch_rows": round(float(np.mean(rows)), 1) if rows else float("nan")}


def _batcher(runtime: Runtime, pool: ThreadPoolExecutor, compute: Any, max_batch: int) -> Batcher:
    b = Batcher(f"bench-b{max_batch}", runtime.infer_sync, executor=pool, compute_ms=compute,
                max_batch=max_batch, max_window_ms=WINDOW_MS if max_batch > 1 else 0.0, site="bench")
    b.start()
    return b


async def _capacity(b: Batcher, name: str, xs: np.ndarray, total: int) -> float:
    k = 0

    async def call() -> object:
        nonlocal k
        k += 1
        return await b.submit({name: xs[k % len(xs)][None, :]}, time.monotonic() + 10.0)

    return await closed_loop_rate(call, total=total, concurrency=64, time_cap_s=20.0)


async def run_batching(ctx: RunContext) -> Path:
    n = ctx.pick(2000, 8000)
    path, provenance = digits_model(["mlp-wide.onnx", "cnn-small.onnx"], (256, 256))
    runtime = open_runtime("onnx", path, providers=["CPUExecutionProvider"])
    runtime.load_sync()
    name = runtime.input_specs[0].name
    xs = digits_rows(512)
    compute = compute_model(runtime.infer_sync, name)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-batch")
    modes = {f"batched (max {MAX_BATCH}, window {WINDOW_MS:g} ms)": MAX_BATCH, "unbatched (max_batch=1)": 1}
    rows: list[dict[str, Any]] = []
    try:
        batchers = {mode: _batcher(runtime, pool, compute, mb) for mode, mb in modes.items()}
        try:
            caps = {mode: round(await _capacity(b, name, xs, ctx.pick(1000, 4000)), 1)
                    for mode, b in batchers.items()}
            base = caps["unbatched (max_batch=1)"]
            for k, factor in enumerate(LOAD_FACTORS):
                order = list(modes) if k % 2 == 0 else list(modes)[::-1]
                for mode in order:
                    rate = factor * base
                    res = await open_loop(batchers[mode], name, xs, rate, n, seed=k,
                                          time_cap_s=n / rate * 2 + 10.0)
                    rows.append({"load": f"{factor:g}x", "offered_rps": round(rate, 1), "mode": mode, **res})
        finally:
            for b in batchers.values():
                await b.stop()
    finally:
        pool.shutdown(wait=True)
        runtime.unload_sync()
    rows.sort(key=lambda r: (r["offered_rps"], r["mode"]))
    top = max(LOAD_FACTORS)
    at_top = {r["mode"]: r for r in rows if r["load"] == f"{top:g}x"}
    bmode, umode = list(modes)
    gain = ratio(at_top[bmode]["throughput_rps"], at_top[umode]["throughput_rps"])
    targets = [target(f"throughput with / without batching at {top:g}x the unbatched capacity", gain, 1.5,
                      op=">=", unit="x")]
    loads = [f"{f:g}x" for f in LOAD_FACTORS]

    def series(key: str) -> dict[str, list[float]]:
        return {m: [next(float(r[key]) for r in rows if r["mode"] == m and r["load"] == ld) for ld in loads]
                for m in modes}

    plot_panels(ctx.results_dir / "batching.png", f"Dynamic batching, open-loop Poisson arrivals ({path.name})", [
        Panel("completed requests/s", "requests/s", loads, series("throughput_rps")),
        Panel("p99 latency from scheduled arrival", "ms (log)", loads, series("p99_ms"), log_y=True)])
    return write_result(ctx, "batching", rows, targets, extra={"capacity_rps": caps}, notes=(
        f"model: {provenance}. Batcher over variant_store's ONNX runtime (1 intra-op thread, 1 executor "
        f"thread); one-row requests, SLO {SLO_S * 1000:g} ms (refused up front when the batcher predicts a "
        f"miss: 'rejected'), {n} requests per cell, open-loop Poisson arrivals. Load = multiple of the "
        f"unbatched closed-loop capacity measured first ({base:g} req/s; batched: "
        f"{caps[bmode]:g} req/s at concurrency 64). Latency from each request's scheduled arrival."))
