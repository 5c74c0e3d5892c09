"""Placement keeps a cascade's stages placed when the cascade can serve a demand (issue 33): stage 1 at the
demand's edge, the last stage where the escalated path fits, neither evicted while the demand lasts."""

from __future__ import annotations

import dataclasses

import pytest

from core_scheduler.policy.placement import PlacementConfig
from core_scheduler.policy.snapshot import MeshSnapshot
from tests.unit.test_placement import NOW, actions, demand, plan, snap
from variant_store.cascade_meta import CascadeMeta

pytestmark = pytest.mark.unit


def with_cascade(s: MeshSnapshot, accuracy: float = 0.99, escalation: float = 0.3) -> MeshSnapshot:
    c = CascadeMeta(task="digits", cascade_id="c1", stages=("tiny.int8", "big.fp32"), rule="max_softmax",
                    thresholds=(0.9,), accuracy=accuracy, escalation=(escalation,), target_accuracy=0.99,
                    calibration_rows=100, heldout_rows=100)
    return dataclasses.replace(s, cascades={"digits": {"c1": c}})  # type: ignore[call-arg]


def test_a_cascade_in_demand_gets_stage_one_at_the_edge_and_its_last_stage_where_it_fits() -> None:
    d = demand(acc=0.99, budget=100.0)
    assert actions(plan(snap({}), [d])) == {("mid1", "big.fp32", "load")}
    p = plan(with_cascade(snap({})), [d])
    assert actions(p) == {("mid1", "big.fp32", "load"), ("edge-a", "tiny.int8", "load")}
    assert "tiny.int8" in p.per_site["edge-a"] and "big.fp32" in p.per_site["mid1"]


@pytest.mark.parametrize(("name", "kw", "budget"), [
    ("accuracy below the floor", {"accuracy": 0.98}, 100.0),
    ("escalated path over budget", {}, 22.0),  # big is 30 ms away at mid1, 52 ms at the core
])
def test_a_cascade_that_cannot_meet_the_demand_places_nothing(name: str, kw: dict[str, float], budget: float) -> None:
    p = plan(with_cascade(snap({}), **kw), [demand(acc=0.99, budget=budget)])
    assert ("edge-a", "tiny.int8", "load") not in actions(p), name


def test_stage_one_is_kept_while_the_cascade_is_in_demand() -> None:
    placed = {"edge-a": {"tiny.int8"}, "mid1": {"big.fp32"}}
    old = {("edge-a", "tiny.int8"): NOW - 10_000.0, ("mid1", "big.fp32"): NOW - 10_000.0}
    d = demand(acc=0.99, budget=100.0)
    cfg = PlacementConfig(idle_evict_s=60.0, min_residency_s=0.0)
    assert ("edge-a", "tiny.int8", "evict") in actions(plan(snap(placed, load_over={}), [d], old, old, cfg))
    p = plan(with_cascade(snap(placed)), [d], old, old, cfg)
    assert "tiny.int8" in p.per_site["edge-a"] and "big.fp32" in p.per_site["mid1"]
