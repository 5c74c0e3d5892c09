"""The chaos invariants over hand-made records: each violation is caught, a clean run passes, and the
recovery time is measured from a fault's heal to the first window back at target."""

from __future__ import annotations

import pytest

from tiermesh.chaos.faults import Fault
from tiermesh.chaos.invariants import FaultWindow, check, timeline
from tiermesh.workload import QueryRecord

pytestmark = pytest.mark.unit


def rec(i: int, t: float, *, ok: bool = True, total: float = 5.0, client: float = 8.0, error: str = "",
        accuracy: float = 0.99, best_effort: bool = False, reply: str | None = None, edge: str = "e1") -> QueryRecord:
    rid = f"q{i}"
    return QueryRecord("c", edge, 60.0, 1, ok, client, total_ms=total if ok else 0.0, accuracy=accuracy if ok else 0.0,
                       best_effort=best_effort, error=error, t=t, min_accuracy=0.97, request_id=rid,
                       reply_id=(rid if reply is None else reply) if ok else "")


def steady(n: int = 200, span: float = 20.0) -> list[QueryRecord]:
    return [rec(i, i * span / n) for i in range(n)]


def test_a_clean_run_passes() -> None:
    rs = steady()
    v = check(rs, len(rs), [FaultWindow("f", 8.0, 9.0)], end_s=20.0, recovery_bound_s=5.0)
    assert v.ok, v.as_dict()
    assert v.recovery_s["f"] == 0.0 and v.baseline == 1.0


@pytest.mark.parametrize("change,field", [
    (lambda rs: rs.pop(), "exactly_once"),                                     # a query never recorded
    (lambda rs: rs.append(rs[0]), "exactly_once"),                             # one recorded twice
    (lambda rs: rs.__setitem__(3, rec(3, 0.3, reply="q4")), "exactly_once"),    # answered as another
    (lambda rs: rs.__setitem__(3, rec(3, 0.3, client=1061.0)), "in_time"),      # past budget + 1 s
    (lambda rs: rs.__setitem__(3, rec(3, 0.3, ok=False, error="internal")), "in_time"),  # untyped
    (lambda rs: rs.__setitem__(3, rec(3, 0.3, accuracy=0.96)), "accuracy"),     # below floor, unflagged
])
def test_each_violation_is_caught(change, field: str) -> None:  # type: ignore[no-untyped-def]
    rs = steady()
    n = len(rs)
    change(rs)
    v = check(rs, n, [], end_s=20.0, recovery_bound_s=5.0)
    assert getattr(v, field) and not v.ok


def test_below_floor_is_fine_when_flagged_and_typed_errors_are_fine() -> None:
    rs = steady()
    rs[3] = rec(3, 0.3, accuracy=0.9, best_effort=True)
    rs[4] = rec(4, 0.4, ok=False, error="peer_down")
    assert check(rs, len(rs), [], end_s=20.0, recovery_bound_s=5.0).ok


def test_recovery_is_measured_from_the_heal_and_bounded() -> None:
    # misses from 8 s to 14 s; the fault healed at 9 s: back at target in the window starting at 14 s
    rs = [rec(i, i * 0.1, total=100.0 if 8.0 <= i * 0.1 < 14.0 else 5.0) for i in range(200)]
    v = check(rs, len(rs), [FaultWindow("slow", 8.0, 9.0)], end_s=20.0, recovery_bound_s=5.0)
    assert v.recovery_s["slow"] == 5.0 and v.ok
    assert not check(rs, len(rs), [FaultWindow("slow", 8.0, 9.0)], end_s=20.0, recovery_bound_s=4.0).ok


def test_queries_to_a_down_edge_are_left_out_of_attainment_only() -> None:
    rs = [rec(i, i * 0.1, ok=not (5.0 <= i * 0.1 <= 8.0) or i % 2 == 0, error="peer_down",
              edge="e2" if i % 2 else "e1") for i in range(200)]
    down = [FaultWindow("kill e2", 5.0, 7.0, down_edge="e2")]
    assert all(a is None or a == 1.0 for _, a, _ in timeline(rs, down, 20.0))
    assert check(rs, len(rs), down, end_s=20.0, recovery_bound_s=2.0).ok


def test_unknown_fault_kind_is_refused() -> None:
    with pytest.raises(Exception, match="unknown fault kind"):
        Fault("meteor", 1.0, 1.0)
