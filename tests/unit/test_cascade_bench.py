"""The cascade benchmark's pure parts (bench/cascade_figures.py): the trace, one arm's figures, the issue's targets."""

from __future__ import annotations

import math

import pytest

from bench.cascade_figures import (
    CASCADES,
    DIGITS,
    EDGES,
    LARGE,
    LARGE_AGAIN,
    TEXT,
    Event,
    Outcome,
    arm_row,
    make_events,
    targets,
)


def test_events_are_deterministic_and_bounded() -> None:
    kw = {"duration_s": 10.0, "qps": 2.0, "sizes": {DIGITS: 50, TEXT: 3}, "rows": {DIGITS: 4, TEXT: 8}}
    a, b = make_events(**kw), make_events(**kw)  # type: ignore[arg-type]
    assert a == b and a != make_events(**kw, seed=1)  # type: ignore[arg-type]
    assert all(0 <= e.t < 10.0 for e in a) and [e.t for e in a] == sorted(e.t for e in a)
    assert {e.edge for e in a} == set(EDGES) and {e.task for e in a} == {DIGITS, TEXT}
    assert 60 < len(a) < 180  # 6 streams x 2 qps x 10 s = 120 expected
    for e in a:
        want = 4 if e.task == DIGITS else 3   # no more rows than the task has, each once
        assert len(e.rows) == len(set(e.rows)) == want and max(e.rows) < (50 if e.task == DIGITS else 3)


def _out(edge: str, rows: int, *, correct: int, site: str, usd: float, ms: float = 10.0, reason: str = "local",
         stages: tuple[str, ...] = (), escalated: int = 0, remote: int = 0, ok: bool = True,
         best_effort: bool = False) -> Outcome:
    o = Outcome(Event(0.0, edge, DIGITS, tuple(range(rows))), budget_ms=100.0, ok=ok, total_ms=ms, site=site,
                reason=reason, correct=correct, usd=usd, stage_sites=stages, rows_escalated=escalated,
                rows_remote=remote, best_effort=best_effort)
    if not ok:
        o.error = "timeout"
    return o


def test_arm_row_counts_wan_cost_and_escalation() -> None:
    e = EDGES[0]
    outs = [
        _out(e, 4, correct=4, site=e, usd=1.0, reason="cascade_local", stages=(e,)),
        _out(e, 4, correct=3, site="core-eu", usd=3.0, reason="cascade_escalated", stages=(e, "core-eu"),
             escalated=1, remote=1, ms=150.0),           # late: misses its SLO
        _out(e, 4, correct=2, site=e, usd=2.0, best_effort=True),
        _out(e, 4, correct=0, site="", usd=0.0, ok=False),
    ]
    r = arm_row(CASCADES, DIGITS, outs)
    assert (r["queries"], r["answered"], r["rows_scored"]) == (4, 3, 12)
    assert r["accuracy"] == pytest.approx(9 / 12, abs=1e-4)
    assert r["accuracy_se"] == pytest.approx(math.sqrt(0.75 * 0.25 / 12), abs=1e-4)
    assert r["wan_share"] == pytest.approx(1 / 3, abs=1e-4)         # only the escalated one left the edge
    assert r["wan_row_share"] == pytest.approx(1 / 12, abs=1e-4)
    assert r["usd_per_1k"] == pytest.approx(2000.0)
    assert r["slo_attainment"] == 0.25                               # late, best effort and failed all miss
    assert r["latency_attainment"] == 0.5
    assert (r["cascade_queries"], r["escalated_queries"], r["escalated_rows"]) == (2, 0.5, 0.125)
    assert r["errors"] == {"timeout": 1}
    assert arm_row(CASCADES, TEXT, outs)["queries"] == 0             # rows are per task


def _row(arm: str, acc: float, wan: float, usd: float, att: float, secs: float | None = None) -> dict[str, object]:
    return {"arm": arm, "task": DIGITS, "accuracy": acc, "accuracy_se": 0.001, "wan_share": wan, "usd_per_1k": usd,
            "compute_s_per_1k": usd / 10.0 if secs is None else secs, "slo_attainment": att, "cascade_queries": 7,
            "answered": 10}


def test_targets_met_and_missed_honestly() -> None:
    rows = [_row(LARGE, 0.990, 1.0, 10.0, 0.98), _row(LARGE_AGAIN, 0.988, 1.0, 12.0, 0.96),
            _row(CASCADES, 0.988, 0.3, 5.0, 0.97)]
    got = {t["name"].split(":")[1].split("(")[0].strip(): t for t in targets(rows)}
    assert len(got) == 5
    acc = next(t for k, t in got.items() if k.startswith("accuracy"))
    assert acc["met"] and acc["measured"] == pytest.approx(0.1)     # 0.989 mean vs 0.988: 0.1 point
    wan = next(t for k, t in got.items() if k.startswith("share"))
    assert wan["met"] and wan["measured"] == 0.3
    cost = next(t for k, t in got.items() if k.startswith("cost"))
    assert cost["met"] and cost["measured"] == pytest.approx(5 / 11, abs=1e-3)
    assert "7 of 10 answers by a cascade" in cost["name"] and "10, 12 USD" in cost["name"]
    secs = next(t for k, t in got.items() if k.startswith("resource-seconds"))
    assert secs["met"] and secs["measured"] == pytest.approx(0.5 / 1.1, abs=1e-3)
    assert not targets([_row(LARGE, 0.99, 1.0, 10.0, 0.98), _row(CASCADES, 0.99, 0.3, 5.0, 0.98, secs=0.9)])[2]["met"]
    att = next(t for k, t in got.items() if k.startswith("SLO"))
    assert att["met"]                                                # 0.97 vs the mean 0.97
    worse = targets([_row(LARGE, 0.990, 1.0, 10.0, 0.98), _row(CASCADES, 0.980, 0.5, 7.0, 0.90)])
    assert [t["met"] for t in worse] == [False, False, False, False, False]
    assert targets([_row(CASCADES, 0.98, 0.5, 7.0, 0.9)]) == []      # no baseline, no verdict
