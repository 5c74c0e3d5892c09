"""Dynamic batching: throughput and tail latency with and without it, at equal offered load.

The model is one whose compute dominates a query: the text family's six-layer FP32 MiniLM encoder
(milliseconds a row; a tiny digits MLP takes microseconds, so the load generator, not the batcher, was
what saturated). It is served as an agent serves it: ``EdgeHttpServer`` -> data plane -> ``Batcher`` ->
ONNX Runtime (one intra-op thread, one executor thread), one text per request as an Open Inference
Protocol ``BYTES`` tensor. The load comes from another process (:mod:`bench.loadgen`): open-loop Poisson
arrivals, bounded in count, time and requests in flight, latency from each request's *scheduled* arrival.
Every cell records the arrival rate the generator really kept; a cell where it kept less than 95 % of
the offered rate is marked invalid (and the target then fails: not measured is not met). Loads are set
relative to the unbatched capacity, measured first in the same run (closed loop, same generator).
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
    cell_s = ctx.pick(6, 15)
    try:
        for mode, mb in modes.items():
            served[mode] = await _serve(path, texts, mb)
        name = next(iter(served.values()))[0].input_name
        specs = {mode: _spec_for(edge.url, name, texts) for mode, (_, edge) in served.items()}
        caps: dict[str, float] = {}
        for mode, spec in specs.items():
            res = await run_load(LoadSpec(**{**spec, "mode": "closed", "concurrency": 16, "n": ctx.pick(200, 500),
                                             "time_cap_s": 30.0, "slo_s": 30.0}))
            caps[mode] = res["throughput_rps"]
        base = caps[umode]
        for k, factor in enumerate(LOAD_FACTORS):
            order = list(modes) if k % 2 == 0 else list(modes)[::-1]
            for mode in order:
                rate = factor * base
                n = max(50, int(rate * cell_s))
                res = await run_load(LoadSpec(**{**specs[mode], "n": n, "rate": rate, "seed": k, "slo_s": SLO_S,
                                                 "time_cap_s": cell_s * 2 + 10.0}))
                rows.append({**res, "arrivals": res["mode"], "load": f"{factor:g}x", "mode": mode})
                await asyncio.sleep(0.5)  # let the last cell's stragglers drain
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
    return write_result(ctx, "batching", rows, targets, extra={"capacity_rps": caps}, notes=(
        f"model: {provenance}. EdgeHttpServer -> Batcher -> ONNX Runtime (1 intra-op thread, 1 executor thread) in "
        f"the bench process; one text per request (V2 BYTES, binary); SLO {SLO_S * 1000:g} ms (refused up front "
        f"when the batcher predicts a miss: 'rejected'); load from a separate generator process (bench.loadgen), "
        f"open-loop Poisson, ~{cell_s} s per cell, at most 2048 requests in flight. Load = multiple of the unbatched "
        f"closed-loop capacity measured first with the same generator ({base:g} req/s at concurrency 16; batched: "
        f"{caps[bmode]:g} req/s). 'achieved_rps' is the arrival rate the generator kept; a cell is valid when it "
        f"kept >= {VALID_SHARE:.0%} of the offered rate. Latency from each request's scheduled arrival."))


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
