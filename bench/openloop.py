"""Open-loop load for in-process servers: Poisson arrivals spread over several submit functions.

Latency runs from each request's *scheduled* arrival (no coordinated omission); the generator says
whether it could offer the rate asked (``valid``: at least 95 % of it), because on a small shared
machine the generator itself can fall behind, and a cell it could not offer measures nothing.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from bench.common import percentile
from edge_agent.batching import BatchResult
from mesh.errors import MeshError

__all__ = ["Submit", "open_loop", "wait_quiet"]

Submit = Callable[[np.ndarray, float], Awaitable[BatchResult]]


async def open_loop(submits: list[Submit], xs: np.ndarray, rate: float, count: int, *, seed: int,
                    time_cap_s: float, slo_s: float) -> dict[str, Any]:
    """Offer ``count`` one-row requests as a Poisson stream of ``rate``/s, each to a random tenant."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, count))
    who = rng.integers(0, len(submits), count)
    lat: list[float] = []
    failed = 0
    tasks: set[asyncio.Task[None]] = set()
    t0, w0 = time.perf_counter(), time.monotonic()

    async def one(i: int) -> None:
        nonlocal failed
        try:
            await submits[int(who[i])](xs[i % len(xs)][None, :], w0 + float(arrivals[i]) + slo_s)
        except MeshError:
            failed += 1
            return
        lat.append(time.perf_counter() - t0 - float(arrivals[i]))

    i = 0
    while i < count and time.perf_counter() - t0 < time_cap_s:
        now = time.perf_counter() - t0
        while i < count and arrivals[i] <= now:
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if i < count:
            await asyncio.sleep(max(0.0, float(arrivals[i]) - (time.perf_counter() - t0)))
    span = float(arrivals[i - 1]) if i else 0.0  # the schedule's span: what was offered
    sent_span = time.perf_counter() - t0
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=slo_s * 10 + 5.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    ms = np.asarray(lat) * 1000.0
    good = int(np.sum(ms <= slo_s * 1000.0))
    offered = i / span if span > 0 else float("nan")
    achieved = i / sent_span if sent_span > 0 else float("nan")
    return {"sent": i, "offered_rps": round(offered, 1), "arrival_rps": round(achieved, 1),
            "valid": bool(achieved >= 0.95 * rate), "refused_or_failed": failed,
            "attained": round(good / i, 4) if i else 0.0,
            "goodput_rps": round(good / max(sent_span, span), 1) if i else 0.0,
            "p50_ms": round(percentile(ms, 50), 2), "p99_ms": round(percentile(ms, 99), 2)}


async def wait_quiet(limit: float, max_wait_s: int) -> float:
    """Sleep until the 1-minute load average is below ``limit`` or ``max_wait_s`` passed; returns it."""
    for _ in range(max_wait_s // 5):
        if os.getloadavg()[0] < limit:
            break
        await asyncio.sleep(5.0)
    return round(os.getloadavg()[0], 2)
