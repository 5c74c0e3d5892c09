"""geo_hetero's trace and its flash-crowd accounting (pure: no mesh)."""

from __future__ import annotations

import pytest

from bench.geo import SystemRun
from bench.geo_hetero import CLASSES, FLASH_EDGE, _targets, flash_row, flash_window, hetero_spec
from bench.traces import Replayed, make_trace

pytestmark = pytest.mark.unit


def test_the_trace_mixes_both_families_three_tenants_and_a_flash_crowd() -> None:
    spec = hetero_spec(quick=True)
    trace = make_trace(spec, 500)
    tasks = {c.task for c in CLASSES}
    assert tasks == {"digit-classification", "text-topic", "text-group"}
    assert {c.tenant for c in CLASSES} == {"public", "acme", "globex"}
    start, end = flash_window(spec)
    assert end - start >= 10.0
    at_flash = [e for e in trace.events if e.edge == FLASH_EDGE and start <= e.t < end]
    elsewhere = [e for e in trace.events if e.edge != FLASH_EDGE and start <= e.t < end]
    assert spec.spike is not None and len(at_flash) > 5 * max(1, len(elsewhere) // 2)
    assert {e.slo_class for e in trace.events} == {c.name for c in CLASSES}


def _rec(edge: str, t: float, met: bool) -> Replayed:
    ev = make_trace(hetero_spec(quick=True), 10).events[0]
    ev = type(ev)(t=t, edge=edge, slo_class="globex-group", sample=0)
    return Replayed(ev, "globex", 150.0, 0, 0.0, ok=True, total_ms=10.0 if met else 500.0)


def test_flash_attainment_counts_only_that_edge_in_that_window() -> None:
    recs = [_rec(FLASH_EDGE, 12.0, True), _rec(FLASH_EDGE, 13.0, False), _rec(FLASH_EDGE, 1.0, False),
            _rec("edge-fra-1", 12.0, False)]
    run = SystemRun("x", recs, {}, {}, 0.0, 0, [])
    assert flash_row(run, (10.0, 20.0)) == {"flash_queries": 2, "flash_slo_met": 1, "flash_attainment": 0.5}


def test_targets_follow_the_issue() -> None:
    rows = [{"system": "tiermesh", "slo_met": 95, "violations": 5, "slo_attainment": 0.95, "resource_s_per_1k": 1.0,
             "flash_attainment": 0.96},
            {"system": "edge-only", "slo_met": 80, "violations": 20, "slo_attainment": 0.8, "resource_s_per_1k": 3.0,
             "flash_attainment": 0.5},
            {"system": "infaas", "slo_met": 90, "violations": 10, "slo_attainment": 0.96, "resource_s_per_1k": 2.0,
             "flash_attainment": 0.9}]
    got = {t["name"].split(" (")[0]: (t["measured"], t["met"]) for t in _targets(rows)}
    assert got["tiermesh SLO-met queries minus the best baseline's"] == (5.0, True)
    assert got["INFaaS-style violations / tiermesh violations"] == (2.0, True)
    assert got["tiermesh resource-s per 1k / the cheapest baseline at >= 95 % attainment"] == (0.5, True)
    assert got[f"edge-only attainment at {FLASH_EDGE} during the flash crowd"] == (0.5, True)
