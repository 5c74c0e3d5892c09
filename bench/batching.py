"""Dynamic batching: throughput and tail latency with and without it, at equal offered load.

The model is one whose compute dominates a query: the text family's six-layer FP32 MiniLM encoder
(milliseconds a row; a tiny digits MLP takes microseconds, so the load generator, not the batcher, was
what saturated). It is served as an agent serves it: ``EdgeHttpServer`` -> data plane -> ``Batcher`` ->
ONNX Runtime (one intra-op thread, one executor thread), one text per request as an Open Inference
Protocol ``BYTES`` tensor. The load comes from another process (:mod:`bench.loadgen`): open-loop Poisson
arrivals, bounded in count, time and requests in flight, latency from each request's *scheduled* arrival.
Every cell records the arrival rate the generator really kept; a cell where it kept less than 95 % of
the offered rate is marked invalid (and the target then fails: not measured is not met). Loads are set
relative to the unbatched capacity, measured first in the same run with the same generator: the larger of
its best closed-loop rate and what it completes under open-loop arrivals beyond that rate (a closed loop
pays each round trip in its rate); if the unbatched mode still keeps up at the top load, its on-time rate
there becomes the capacity and the top cells are measured again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Panel, RunContext, plot_panels, ratio, target, write_result
from bench.floors import ModelDataPlane
from bench.loadgen import VALID_SHARE, LoadSpec, run_load
from edge_agent.http_api import EdgeHttpServer
from mesh.v2 import codec as codec
from mesh.v2.body import HEADER_LENGTH

__all__ = ["LOAD_FACTORS", "run_batching", "text_model"]

LOAD_FACTORS = (0.5, 1.0, 2.0)  # x the unbatched capacity
SLO_S = 0.5
MAX_BATCH = 16
WINDOW_MS = 20.0
CAPACITY_RUNS = 3               # closed-loop capacity: the best of this many runs per mode
OVERLOAD = 2.5                  # x the closed-loop capacity: the open-loop overload that calibrates it
RECALIBRATIONS = 2              # top cells measured again when the unbatched mode kept up there
KEPT_UP = 0.95                  # ... i.e. finished this share of the offered rate within the SLO
ENCODER = "minilm-l6"           # FP32, six layers: batches of 8-16 rows run ~2x faster per row on CPU
TASK = "text-embedding"


def text_model(encoder: str = ENCODER) -> tuple[Path, list[bytes], str]:
    """The encoder's ONNX file (the text family, built once and cached), held-out texts, provenance."""
    from variant_store.build_text import text_family_dir
    from variant_store.families.text_corpus import load_corpus

    root = text_family_dir()
    x, _ = load_corpus().holdout()
    return root / f"{encoder}.onnx", [bytes(t) for t in x], f"{encoder}.onnx from the text family in {root}"


def _text_compute(dp: ModelDataPlane, texts: list[bytes]) -> Callable[[int], float]:
    """A linear compute model (ms per batch of n rows) from runs at 1 and 8 rows, as a profile gives."""
    ms = {}
    for n in (1, 8):
        x = {dp.input_name: np.array(texts[:n], dtype=object)}
        dp.runtime.infer_sync(x)
        t = time.perf_counter()
        for _ in range(5):
            dp.runtime.infer_sync(x)
        ms[n] = (time.perf_counter() - t) / 5 * 1000.0
    slope = max(0.0, (ms[8] - ms[1]) / 7)
    base = max(0.001, ms[1] - slope)
    return lambda n: base + slope * n


async def _serve(path: Path, texts: list[bytes], max_batch: int) -> tuple[ModelDataPlane, EdgeHttpServer]:
    dp = ModelDataPlane(path, task=TASK, max_batch=max_batch, max_window_ms=WINDOW_MS if max_batch > 1 else 0.0,
                        compute_ms=lambda dp: _text_compute(dp, texts))
    dp.start()
    edge = EdgeHttpServer(dp, "127.0.0.1")
    await edge.start()
    return dp, edge


async def run_batching(ctx: RunContext) -> Path:
    path, texts, provenance = text_model()
    texts = texts[:64]
    modes = {f"batched (max {MAX_BATCH}, window {WINDOW_MS:g} ms)": MAX_BATCH, "unbatched (max_batch=1)": 1}
    umode = "unbatched (max_batch=1)"
    bmode = next(m for m in modes if m != umode)
    served: dict[str, tuple[ModelDataPlane, EdgeHttpServer]] = {}
    rows: list[dict[str, Any]] = []
    recalibrated: list[float] = []
    cell_s = ctx.pick(6, 15)
    try:
        for mode, mb in modes.items():
            served[mode] = await _serve(path, texts, mb)
        name = next(iter(served.values()))[0].input_name
        specs = {mode: _spec_for(edge.url, name, texts) for mode, (_, edge) in served.items()}
        # capacity is a maximum: a co-tenant's burst on this shared machine only lowers a measure, so the best
        # of several closed-loop runs, modes taking turns
        caps: dict[str, float] = {}
        for rep in range(ctx.pick(2, CAPACITY_RUNS)):
            for mode in (list(specs) if rep % 2 == 0 else list(specs)[::-1]):
                res = await run_load(LoadSpec(**{**specs[mode], "mode": "closed", "concurrency": 16,
                                                 "n": ctx.pick(200, 500), "time_cap_s": 30.0, "slo_s": 30.0}))
                caps[mode] = max(caps.get(mode, 0.0), res["throughput_rps"])
        # a closed loop of 16 callers pays each round trip in its rate: open-loop arrivals beyond that rate
        # show what the unbatched mode really completes when more is offered than it can take
        over_rate = OVERLOAD * caps[umode]
        over = await run_load(LoadSpec(**{**specs[umode], "n": max(50, int(over_rate * cell_s / 2)), "rate": over_rate,
                                          "seed": 99, "slo_s": SLO_S, "time_cap_s": cell_s + 10.0}))
        caps["unbatched, open-loop overload"] = over["throughput_rps"]
        base = max(caps[umode], over["throughput_rps"])

        async def cell(factor: float, mode: str, seed: int, label: str) -> dict[str, Any]:
            rate = factor * base
            n = max(50, int(rate * cell_s))
            res = await run_load(LoadSpec(**{**specs[mode], "n": n, "rate": rate, "seed": seed, "slo_s": SLO_S,
                                             "time_cap_s": cell_s * 2 + 10.0}))
            row = {**res, "arrivals": res["mode"], "load": label, "mode": mode, "capacity_base_rps": base}
            rows.append(row)
            await asyncio.sleep(0.5)  # let the last cell's stragglers drain
            return row

        top_factor = max(LOAD_FACTORS)
        for k, factor in enumerate(LOAD_FACTORS):
            for mode in (list(modes) if k % 2 == 0 else list(modes)[::-1]):
                await cell(factor, mode, k, f"{factor:g}x")
        # the unbatched mode kept up at the top load: its capacity was measured low (the machine was busier
        # then), so the top cells did not load it to the factor they claim. Its on-time rate there is a
        # capacity it really has: measure the top load again from that, at most RECALIBRATIONS times.
        for attempt in range(RECALIBRATIONS):
            utop = [r for r in rows if r["load"] == f"{top_factor:g}x" and r["mode"] == umode][-1]
            if utop["on_time_rps"] < KEPT_UP * utop["offered_rps"]:
                break
            base = max(base, utop["on_time_rps"])
            for mode in (list(modes) if attempt % 2 else list(modes)[::-1]):
                rows = [r for r in rows if not (r["load"] == f"{top_factor:g}x" and r["mode"] == mode)]
                await cell(top_factor, mode, 100 + attempt, f"{top_factor:g}x")
            recalibrated.append(base)
        rows.append({"load": "batch sizes", "mode": bmode, "mean_batch_rows": _mean_batch(served[bmode][0])})
    finally:
        for dp, edge in served.values():
            await edge.stop()
            await dp.close()
    cells = [r for r in rows if r["load"] != "batch sizes"]
    top = f"{max(LOAD_FACTORS):g}x"
    at_top = {r["mode"]: r for r in cells if r["load"] == top}
    valid_top = all(r["valid"] for r in at_top.values())
    gain = ratio(at_top[bmode]["throughput_rps"], at_top[umode]["throughput_rps"]) if valid_top else float("nan")
    kept = min(r["achieved_rps"] / r["offered_rps"] for r in at_top.values())
    targets = [target(f"throughput with / without batching at {top} the unbatched capacity (valid cells only)",
                      gain, 1.5, op=">=", unit="x"),
               target(f"generator's achieved / offered arrival rate at {top} (lowest of the two cells)",
                      round(kept, 3), VALID_SHARE, op=">=")]
    loads = [f"{f:g}x" for f in LOAD_FACTORS]

    def series(key: str) -> dict[str, list[float]]:
        return {m: [next(float(r[key] or 0.0) for r in cells if r["mode"] == m and r["load"] == ld) for ld in loads]
                for m in modes}

    plot_panels(ctx.results_dir / "batching.png", f"Dynamic batching, open-loop Poisson arrivals ({path.name})", [
        Panel("completed requests/s", "requests/s", loads, series("throughput_rps")),
        Panel("p99 latency from scheduled arrival", "ms (log)", loads, series("p99_ms"), log_y=True)])
    again = (f" The unbatched mode kept up with the first top load, so its capacity was taken from its on-time rate "
             f"there and the top cells measured again ({', '.join(f'{b:g}' for b in recalibrated)} req/s)."
             if recalibrated else "")
    return write_result(ctx, "batching", rows, targets, extra={"capacity_rps": caps, "recalibrated": recalibrated},
                        notes=(
        f"model: {provenance}. EdgeHttpServer -> Batcher -> ONNX Runtime (1 intra-op thread, 1 executor thread) in "
        f"the bench process; one text per request (V2 BYTES, binary); SLO {SLO_S * 1000:g} ms (refused up front "
        f"when the batcher predicts a miss: 'rejected'); load from a separate generator process (bench.loadgen), "
        f"open-loop Poisson, ~{cell_s} s per cell, at most 2048 requests in flight. Load = multiple of the unbatched "
        f"capacity, measured first with the same generator: {base:g} req/s, the larger of its closed-loop "
        f"rate (best of {ctx.pick(2, CAPACITY_RUNS)} runs at concurrency 16: {caps[umode]:g} req/s; batched "
        f"{caps[bmode]:g}) and what it completed under open-loop arrivals at {OVERLOAD:g}x that rate "
        f"({caps['unbatched, open-loop overload']:g} req/s). 'achieved_rps' is the arrival "
        f"rate the generator kept; a cell is valid when it kept >= {VALID_SHARE:.0%} of the offered rate. Latency "
        f"from each request's scheduled arrival." + again))


def _spec_for(url: str, name: str, texts: list[bytes]) -> dict[str, Any]:
    """The request bodies, one text each, with each body's own JSON header length."""
    bodies, lengths = [], []
    for t in texts:
        body, hlen = codec.encode_infer_request({name: np.array([t], dtype=object)}, {"latency_ms": SLO_S * 1000})
        assert hlen is not None
        bodies.append(body)
        lengths.append({HEADER_LENGTH: str(hlen)})
    return {"url": f"{url}/v2/models/{TASK}/infer", "bodies": bodies, "body_headers": lengths,
            "headers": {"Content-Type": "application/octet-stream"}}


def _mean_batch(dp: ModelDataPlane) -> float:
    b = dp.batcher
    return round(b.served / b.batches, 2) if b.batches else float("nan")
