"""The benchmark suite's pure helpers: statistics, ratios, targets, interleaving, the results JSON and
the generic BENCHMARKS.md rendering."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.common import (
    RunContext,
    closed_loop_rate,
    interleave,
    percentile,
    ratio,
    summarize,
    target,
    write_result,
)
from bench.report import fmt, load_results, render, render_table, target_sentence

pytestmark = pytest.mark.unit


def test_percentile_and_summary_follow_the_samples() -> None:
    rng = np.random.default_rng(1)
    samples = rng.exponential(1e-4, 1000)
    s = summarize(samples)
    assert s["n"] == 1000
    assert s["median_us"] == pytest.approx(np.median(samples) * 1e6, abs=0.1)
    assert s["median_us"] < s["p99_us"]
    assert s["p99_us"] == pytest.approx(percentile(samples * 1e6, 99), abs=0.1)
    assert math.isnan(percentile([], 50))


def test_one_outlier_moves_p99_not_the_median() -> None:
    base = [1e-5] * 200
    s0, s1 = summarize(base), summarize([*base[:-3], 1.0, 1.0, 1.0])
    assert s1["median_us"] == s0["median_us"]
    assert s1["p99_us"] > 1000 * s0["p99_us"]


@pytest.mark.parametrize(("system", "floor", "expected"), [(130.0, 100.0, 1.3), (50.0, 100.0, 0.5)])
def test_ratio(system: float, floor: float, expected: float) -> None:
    assert ratio(system, floor) == pytest.approx(expected)


@pytest.mark.parametrize("floor", [0.0, -1.0, float("nan")])
def test_ratio_without_a_floor_is_not_a_number(floor: float) -> None:
    assert math.isnan(ratio(1.0, floor))


def test_targets_met_and_missed_both_ways() -> None:
    assert target("a", 1.2, 1.3)["met"] is True
    assert target("a", 1.31, 1.3)["met"] is False
    assert target("b", 2.0, 1.5, op=">=")["met"] is True
    assert target("b", 1.0, 1.5, op=">=")["met"] is False
    nan = target("c", float("nan"), 1.3)
    assert nan["met"] is False and nan["measured"] is None


async def test_interleave_alternates_and_counts() -> None:
    order: list[str] = []

    def make(label: str) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            order.append(label)
        return call

    out = await interleave({"floor": make("floor"), "system": make("system")}, rounds=3, per_round=2, warmup=1)
    assert [len(v) for v in out.values()] == [6, 6]
    assert all(t >= 0 for v in out.values() for t in v)
    timed = order[2:]  # after one warm-up call each
    assert timed == ["floor"] * 2 + ["system"] * 4 + ["floor"] * 4 + ["system"] * 2


async def test_closed_loop_rate_is_bounded_in_count() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1

    rate = await closed_loop_rate(call, total=57, concurrency=8)
    assert calls == 57
    assert rate > 0


def test_write_result_schema_and_no_nan(tmp_path: Path) -> None:
    ctx = RunContext(quick=True, results_dir=tmp_path, command="python -m bench --quick")
    path = write_result(ctx, "demo", [{"case": "x", "ratio": float("nan"), "v": np.float32(2.5)}],
                        [target("t", 1.0, 2.0)])
    doc = json.loads(path.read_text())  # strict JSON: a NaN would not parse back as null
    assert doc["scenario"] == "demo" and doc["quick"] is True
    assert {"cpu", "cores", "python", "platform"} <= set(doc["machine"])
    assert {"numpy", "onnxruntime", "pyzmq", "aiohttp"} <= set(doc["versions"])
    assert doc["git_commit"] and doc["timestamp"]
    assert doc["rows"] == [{"case": "x", "ratio": None, "v": 2.5}]
    assert load_results(tmp_path)[0]["scenario"] == "demo"


def test_render_is_generic_and_says_what_was_missed() -> None:
    docs: list[dict[str, Any]] = [
        {"scenario": "geo_trace", "command": "python -m bench.geo", "quick": False, "rows": [
            {"city": "a", "p99_ms": 12.5}, {"city": "b", "p99_ms": 40.0, "extra": True}],
         "targets": [{"name": "p99 under 30 ms", "target": 30, "op": "<=", "unit": "ms", "measured": 40.0,
                      "met": False},
                     {"name": "attainment", "target": 0.9, "op": ">=", "measured": 0.95, "met": True}]},
        {"bench": "routing.decide", "runs": [{"candidates": 100, "median_us": 5.5}],
         "notes_note": "re-read by hand"},
    ]
    md = render(docs, pngs=frozenset({"geo_trace"}))
    assert md.count("Note added after the run") == 1 and "*Note added after the run:* re-read by hand" in md
    assert "## geo_trace" in md and "## routing.decide" in md
    assert "| city | p99_ms | extra |" in md
    assert "| b | 40.0 | yes |" in md
    assert "1 of 2 targets met" in md
    assert "p99 under 30 ms: **MISSED** — measured 40.0 ms, target ≤ 30 ms" in md
    assert "attainment: met" in md
    assert "`python -m bench.geo`" in md
    assert "![geo_trace](bench/results/geo_trace.png)" in md
    assert "routing.decide.png" not in md
    assert "| 100 | 5.5 |" in md


def test_cells_and_sentences() -> None:
    assert fmt(float("nan")) == "n/a"
    assert fmt(None) == "" and fmt(False) == "no"
    assert fmt(1234567.0) == "1,234,567"
    assert fmt("a|b") == "a\\|b"
    assert render_table([]) == "_no rows_\n"
    assert "not measured" in target_sentence({"name": "x", "target": 1, "measured": None, "met": False})


def test_git_commit_of_a_copied_tree_is_what_the_copier_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree copied to a lent GPU machine may sit over another checkout's .git: the commit it was copied from,
    given in TIERMESH_SOURCE_COMMIT, wins over what git there says."""
    from bench.common import git_commit

    monkeypatch.delenv("TIERMESH_SOURCE_COMMIT", raising=False)
    assert git_commit(tmp_path) == "unknown"  # no git here
    monkeypatch.setenv("TIERMESH_SOURCE_COMMIT", "f9d18da")
    assert git_commit(tmp_path) == "f9d18da"


def test_git_commit_ignores_what_the_benchmarks_write(tmp_path: Path) -> None:
    import subprocess

    from bench.common import git_commit

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "x.json").write_text("{}")
    (tmp_path / "BENCHMARKS.md").write_text("old")
    (tmp_path / "code.py").write_text("a = 1")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    (tmp_path / "bench" / "results" / "x.json").write_text('{"new": 1}')
    (tmp_path / "BENCHMARKS.md").write_text("new")
    assert not git_commit(tmp_path).endswith("+dirty")
    (tmp_path / "code.py").write_text("a = 2")
    assert git_commit(tmp_path).endswith("+dirty")
