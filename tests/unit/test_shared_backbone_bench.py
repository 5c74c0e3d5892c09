"""The shared_backbone benchmark's measuring helpers (bench.openloop, bench.shared_backbone): the
generator's validity, rounds taken in turns and their medians, the climb, the added-p50 target."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest

from bench.openloop import climb, interleaved_rounds, median_of_rounds, open_loop
from bench.shared_backbone import added_p50_ms
from edge_agent.batch_parts import BatchResult

pytestmark = pytest.mark.unit


async def _answer(x: np.ndarray, deadline: float) -> BatchResult:
    return BatchResult({"y": x}, 0.0, 0.0, 1)


async def test_a_slow_poisson_draw_is_not_read_as_a_generator_that_fell_behind() -> None:
    # seed 0's schedule of 400 arrivals at 400/s spans ~1.13 s: its own rate is ~0.89x the rate asked
    res = await open_loop([_answer], np.zeros((4, 2), np.float32), 400.0, 400, seed=0, time_cap_s=30.0, slo_s=1.0)
    assert res["sent"] == 400
    assert res["offered_rps"] < 0.95 * 400.0
    # judged against the schedule, not the rate asked: valid whenever it kept up with the schedule
    assert res["valid"] == (res["arrival_rps"] >= 0.95 * res["offered_rps"])


async def test_a_generator_held_up_by_its_server_is_invalid() -> None:
    calls = 0

    async def blocking(x: np.ndarray, deadline: float) -> BatchResult:
        nonlocal calls
        calls += 1
        if calls == 1:
            time.sleep(1.5)  # noqa: ASYNC251 -- on purpose: holds the loop the generator runs on
        return BatchResult({"y": x}, 0.0, 0.0, 1)

    # a schedule of ~1 s; the first request holds the loop 1.5 s, so the rest goes out late (however
    # the busy machine delays the first send, short of the whole second)
    res = await open_loop([blocking], np.zeros((4, 2), np.float32), 100.0, 100, seed=1, time_cap_s=30.0, slo_s=5.0)
    assert res["sent"] == 100
    assert res["valid"] is False
    assert res["arrival_rps"] < 0.8 * res["offered_rps"]


async def test_rounds_take_turns_and_reverse_the_order_every_other_round() -> None:
    calls: list[tuple[str, int]] = []

    async def cell(mode: str, r: int) -> dict[str, Any]:
        calls.append((mode, r))
        return {"valid": True, "p50_ms": float(r)}

    rounds = await interleaved_rounds(["a", "b", "c"], 3, cell)
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("c", 2)]
    assert [list(r) for r in rounds] == [["a", "b", "c"]] * 3  # every round keyed in the modes' order
    assert rounds[1]["b"]["p50_ms"] == 1.0


def _round(a: float, b: float, *, valid_b: bool = True, refused: int = 0) -> dict[str, dict[str, Any]]:
    return {"a": {"valid": True, "p50_ms": a, "p99_ms": 10 * a, "refused_or_failed": refused},
            "b": {"valid": valid_b, "p50_ms": b, "p99_ms": 10 * b, "refused_or_failed": 0}}


def test_median_of_rounds_ignores_one_bad_round_and_drops_invalid_rounds_for_every_mode() -> None:
    rounds = [_round(2.0, 3.0), _round(2.2, 3.1, refused=4), _round(50.0, 3.2),  # a noisy spell hit a
              _round(0.1, 99.0, valid_b=False, refused=7)]  # the generator fell behind for b: dropped for a too
    out = median_of_rounds(rounds, ("p50_ms", "p99_ms"))
    assert out["a"] == {"p50_ms": 2.2, "p99_ms": 22.0, "rounds_valid": 3, "refused_or_failed": 4}
    assert out["b"]["p50_ms"] == 3.1
    assert out["b"]["rounds_valid"] == 3


def test_median_of_rounds_without_a_valid_round_is_not_a_number() -> None:
    out = median_of_rounds([_round(1.0, 2.0, valid_b=False)], ("p50_ms",))
    assert math.isnan(out["a"]["p50_ms"])
    assert out["a"]["rounds_valid"] == 0


def _row(mode: str, p50: float, valid: int) -> dict[str, Any]:
    return {"tenants": 4, "mode": mode, "light_p50_ms": p50, "light_rounds_valid": valid}


def test_added_p50_needs_a_majority_of_valid_rounds() -> None:
    rows = [_row("copies", 3.0, 3), _row("shared+batching", 4.5, 5)]
    assert added_p50_ms(rows, 4, "shared+batching", "copies", 5) == pytest.approx(1.5)
    rows[0]["light_rounds_valid"] = 2
    assert math.isnan(added_p50_ms(rows, 4, "shared+batching", "copies", 5))


async def test_climb_retries_a_failed_step_once_and_marks_a_step_the_generator_could_not_offer() -> None:
    limits = {"slow": 250.0, "capped": 1e9}

    async def cell(mode: str, rate: float, turn: int) -> dict[str, Any]:
        if mode == "capped" and rate > 300:
            return {"valid": False, "attained": 1.0, "goodput_rps": 0.0}
        ok = rate <= limits[mode]
        return {"valid": True, "attained": 1.0 if ok else 0.5, "goodput_rps": rate if ok else rate / 2}

    out = await climb(["slow", "capped"], cell, start=100.0, step=2.0, max_rate=1e6, attained=0.99)
    steps, best, capped = out["slow"]
    assert [s["attained"] for s in steps] == [1.0, 1.0, 0.5, 0.5]  # 100, 200, 400 tried twice
    assert (best, capped) == (200.0, False)
    steps, best, capped = out["capped"]
    assert (len(steps), best, capped) == (3, 200.0, True)  # 100, 200 pass; 400 cannot be offered


async def test_climb_refines_between_the_last_pass_and_the_failure() -> None:
    limit = 300.0
    seen: list[float] = []

    async def cell(mode: str, rate: float, turn: int) -> dict[str, Any]:
        seen.append(rate)
        ok = rate <= limit
        return {"valid": True, "attained": 1.0 if ok else 0.5, "goodput_rps": rate if ok else rate / 2}

    out = await climb(["m"], cell, start=100.0, step=2.0, max_rate=1e6, attained=0.99, refine=3)
    steps, best, capped = out["m"]
    assert len(steps) == len(seen)
    assert not capped
    # 100, 200 pass; 400 fails twice; then sqrt(200*400)=283 passes, sqrt(283*400)=336 fails twice,
    # sqrt(283*336)=308 fails twice: the limit is bracketed within 2 ** (1/8)
    assert [round(r) for r in seen] == [100, 200, 400, 400, 283, 336, 336, 308, 308]
    assert best == pytest.approx(282.84, abs=0.01)
    assert best <= limit < best * 2 ** (1 / 8)
    # refine=0 keeps the old behaviour: the ladder's own step is the resolution
    seen.clear()
    _, best0, _ = (await climb(["m"], cell, start=100.0, step=2.0, max_rate=1e6, attained=0.99))["m"]
    assert best0 == 200.0 and len(seen) == 4
