"""Eviction to make room: least demanded idle residents first, backbones counted once, busy and
protected ones never, and no partial eviction when room cannot be made."""

from __future__ import annotations

import pytest

from core_scheduler.policy.eviction import DEMAND_TAU_S, Resident, decayed_rate, plan_eviction

pytestmark = pytest.mark.unit

R = Resident


@pytest.mark.parametrize(("residents", "need", "free", "want"), [
    # fits already
    ([R("a", 10)], 5, 5, []),
    # lowest demand goes first, even when it was used more recently than a steady one
    ([R("hot", 10, qps=5.0, idle_s=30.0), R("cold", 10, qps=0.1, idle_s=1.0)], 10, 0, ["cold"]),
    # equal demand: least recently used first
    ([R("new", 10, idle_s=1.0), R("old", 10, idle_s=50.0)], 10, 0, ["old"]),
    # equal demand and idleness: the larger first (fewer victims)
    ([R("small", 5), R("big", 20)], 10, 0, ["big"]),
    # several victims when one is not enough, in order of value
    ([R("a", 4, qps=1.0), R("b", 4, qps=2.0), R("c", 4, qps=3.0)], 8, 0, ["a", "b"]),
    # busy residents are never victims
    ([R("busy", 100, busy=True), R("idle", 10, qps=9.0)], 10, 0, ["idle"]),
    # cannot fit even with every idle one gone: refuse, evict nothing
    ([R("busy", 100, busy=True), R("idle", 10)], 50, 0, None),
])
def test_plan_eviction(residents: list[Resident], need: int, free: int, want: list[str] | None) -> None:
    assert plan_eviction(residents, {}, need, free) == want


def test_a_shared_backbone_is_freed_only_with_its_last_head() -> None:
    heads = [R("h1", 1, base="bb", idle_s=9.0), R("h2", 1, base="bb", idle_s=8.0), R("m", 30, qps=1.0)]
    # the backbone (100) comes back only once both heads go: that beats unloading the busier model
    assert plan_eviction(heads, {"bb": 100}, 50, 0) == ["h1", "h2"]
    # one head alone frees only its own byte
    assert plan_eviction(heads, {"bb": 100}, 1, 0) == ["h1"]


def test_protected_residents_stay() -> None:
    rs = [R("sibling", 10, base="bb"), R("other", 10, qps=5.0)]
    assert plan_eviction(rs, {"bb": 50}, 10, 0, protect={"sibling"}) == ["other"]
    assert plan_eviction(rs, {"bb": 50}, 30, 0, protect={"sibling"}) is None


def test_decayed_rate() -> None:
    assert decayed_rate(2.0, 0.0) == 2.0
    assert decayed_rate(2.0, DEMAND_TAU_S) == pytest.approx(2.0 / 2.718281828, rel=1e-6)
    assert decayed_rate(2.0, -5.0) == 2.0  # a clock step back never raises demand
