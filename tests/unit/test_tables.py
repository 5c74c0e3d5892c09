"""The demo's summary at 80 columns (a laptop's terminal, and rich's width when stdout is a pipe, as in
``make demo | cat``): every header word whole, nothing cut with an ellipsis, wide or stacked."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from rich.console import Console

from tiermesh.tables import FitTable
from tiermesh.workload import QueryRecord, by_edge, render_edges, render_table, summarise

pytestmark = pytest.mark.unit

TIERS = {"edge-par-1": "edge", "edge-fra-1": "edge", "edge-nyc-1": "edge", "mid-eu": "middle", "core-1": "core"}


def _records() -> list[QueryRecord]:
    out = []
    for i in range(60):
        name, budget, floor = [("tight", 10, 0.9), ("balanced", 60, 0.97), ("accurate", 400, 0.985),
                               ("text", 300, 0.7)][i % 4]
        site = ["edge-par-1", "mid-eu", "core-1"][i % 3]
        ok = i % 11 != 0
        out.append(QueryRecord(slo_class=name, edge=["edge-par-1", "edge-fra-1", "edge-nyc-1"][i % 3],
                               budget_ms=budget, label=1, ok=ok, client_ms=5.0 + i, total_ms=4.0 + i,
                               site=site if ok else "", variant=f"digits-cnn-wide-int8-{i % 3}" if ok else "",
                               accuracy=0.99, predicted=1, min_accuracy=floor,
                               error="" if ok else "impossible_slo"))
    return out


def _render(renderable: object, width: int) -> str:
    out = StringIO()
    Console(width=width, file=out, color_system=None).print(renderable)
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 60, 200])
def test_summary_never_cuts_a_header_or_a_cell(width: int) -> None:
    records = _records()
    summary = summarise(records, TIERS)
    for table in (render_table(summary), render_edges(by_edge(records))):
        text = _render(table, width)
        assert "…" not in text, text
        assert max(len(line) for line in text.splitlines()) <= width
        words = {w.strip(":,│┃") for w in text.split()}
        for header in table.headers:
            for word in header.split():
                assert word in words, f"header word {word!r} not whole at {width} columns:\n{text}"
        for row in table.rows:
            for cell in row:
                for word in cell.split():
                    assert word.rstrip(":,") in words, f"cell word {word!r} not whole at {width} columns:\n{text}"


def test_wide_where_it_fits_stacked_where_it_does_not() -> None:
    table = FitTable("t", ["class", "served at"], [["tight", "edge:3, core:1"]])
    wide = _render(table, 80)
    assert re.search(r"class\s+┃\s+served at", wide), wide
    stacked = _render(FitTable("t", ["class", *(f"column{i}" for i in range(12))],
                               [["tight", *(f"value-{i}" for i in range(12))]]), 80)
    assert "class tight" in stacked and "column11: value-11" in stacked.replace("  ", " "), stacked
