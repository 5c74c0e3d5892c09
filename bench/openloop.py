"""Open-loop load for in-process servers: Poisson arrivals spread over several submit functions.

Latency runs from each request's *scheduled* arrival (no coordinated omission); the generator says
whether it kept up with its schedule (``valid``: it sent at no less than 95 % of the schedule's own
rate), because on a small shared machine the generator itself can fall behind, and a cell it could
not offer measures nothing. (The schedule is a Poisson draw: its own rate is within a few per cent of
the rate asked, either side; judged against the rate asked, a slow draw would read as a generator
that fell behind.)

``interleaved_rounds`` and ``median_of_rounds``: several modes measured in rounds, taking turns, and
summarised by the median of the rounds, so that a noisy spell of a shared machine hits every mode
alike and one bad round moves nothing.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from bench.common import percentile
from edge_agent.batch_parts import BatchResult
from mesh.errors import MeshError

__all__ = ["Submit", "climb", "interleaved_rounds", "median_of_rounds", "open_loop", "wait_quiet"]

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
            "valid": bool(achieved >= 0.95 * offered), "refused_or_failed": failed,
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


async def climb(modes: Sequence[str], cell: Callable[[str, float, int], Awaitable[dict[str, Any]]], *,
                start: float, step: float, max_rate: float, attained: float,
                refine: int = 0) -> dict[str, tuple[list[dict[str, Any]], float, bool]]:
    """Per mode: raise the offered rate from ``start`` by ``step`` while ``attained`` of the requests
    finish within the SLO (``cell(mode, rate, turn)`` offers one step). The modes take turns (the
    order alternating), so a noisy spell of a shared machine does not land on one mode only; a failed
    step is tried once more before it ends that mode's climb. A step the generator cannot offer ends
    the climb too, marked (the mode's real limit is higher), as does passing ``max_rate``.

    ``refine`` > 0: once a step has failed twice, that many more steps bisect (geometrically) between
    the last rate that passed and the one that failed, each failure again tried once more, so the limit
    is known to within ``step ** (1 / 2 ** refine)`` rather than ``step``. Returns per mode: the steps,
    the best goodput of a passing step, and whether the generator ended the climb."""
    steps: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    best = dict.fromkeys(modes, 0.0)
    capped = dict.fromkeys(modes, False)
    rate = dict.fromkeys(modes, start)
    fails = dict.fromkeys(modes, 0)
    bracket: dict[str, tuple[float, float, int]] = {}  # mode -> (passed, failed, bisections left)
    alive = list(modes)
    turn = 0

    def passed(mode: str, goodput: float) -> None:
        fails[mode] = 0
        best[mode] = max(best[mode], goodput)
        if mode in bracket:
            _, hi, left = bracket[mode]
            bisect(mode, rate[mode], hi, left)
            return
        rate[mode] *= step
        if rate[mode] > max_rate:
            capped[mode] = True
            alive.remove(mode)

    def failed(mode: str) -> None:
        fails[mode] += 1
        if fails[mode] < 2:
            return
        fails[mode] = 0
        if mode in bracket:
            lo, _, left = bracket[mode]
            bisect(mode, lo, rate[mode], left)
        elif refine > 0 and best[mode] > 0:
            bisect(mode, rate[mode] / step, rate[mode], refine)
        else:
            alive.remove(mode)

    def bisect(mode: str, lo: float, hi: float, left: int) -> None:
        if left <= 0:
            alive.remove(mode)
            return
        bracket[mode] = (lo, hi, left - 1)
        rate[mode] = math.sqrt(lo * hi)

    while alive:
        for mode in list(alive if turn % 2 == 0 else alive[::-1]):
            res = await cell(mode, rate[mode], turn)
            steps[mode].append(res)
            if not res["valid"]:
                capped[mode] = True
                alive.remove(mode)
            elif res["attained"] < attained:
                failed(mode)
            else:
                passed(mode, float(res["goodput_rps"]))
        turn += 1
    return {m: (steps[m], best[m], capped[m]) for m in modes}


async def interleaved_rounds(modes: Sequence[str], rounds: int,
                             cell: Callable[[str, int], Awaitable[dict[str, Any]]]) -> list[dict[str, dict[str, Any]]]:
    """``rounds`` rounds of ``cell(mode, round)`` for every mode in turn, the order reversed every
    other round; one dict of cells (by mode) per round."""
    out: list[dict[str, dict[str, Any]]] = []
    for r in range(rounds):
        order = list(modes) if r % 2 == 0 else list(modes)[::-1]
        cells = {m: await cell(m, r) for m in order}
        out.append({m: cells[m] for m in modes})
    return out


def median_of_rounds(rounds: Sequence[dict[str, dict[str, Any]]], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per mode: the median over rounds of each of ``keys`` (NaN when no round counts), counting
    only the rounds in which *every* mode's cell is ``valid`` (a round the generator could not offer
    to one mode is dropped for all, so the modes stay compared over the same rounds);
    ``rounds_valid`` says how many counted, ``refused_or_failed`` sums those rounds' refusals."""
    modes = list(rounds[0]) if rounds else []
    ok = [r for r in rounds if all(bool(r[m]["valid"]) for m in modes)]
    out: dict[str, dict[str, Any]] = {}
    for m in modes:
        row: dict[str, Any] = {}
        for k in keys:
            vals = [float(r[m][k]) for r in ok if not math.isnan(float(r[m][k]))]
            row[k] = round(float(np.median(vals)), 2) if vals else float("nan")
        row["rounds_valid"] = len(ok)
        row["refused_or_failed"] = int(sum(int(r[m].get("refused_or_failed", 0)) for r in ok))
        out[m] = row
    return out
