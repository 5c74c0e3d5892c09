"""A calibrated cascade as a routing candidate (issue 33): feasible only on its escalated path, ranked by its
expected latency and cost, chosen only when cheaper than every plain candidate, judged on its own accuracy."""

from __future__ import annotations

import numpy as np
import pytest

from core_scheduler.policy.explain import explain
from core_scheduler.policy.routing import CascadeDecision, Query, RoutingTable
from core_scheduler.policy.routing_cascade import cascade_entries, combine, plan_for
from tests.unit.test_routing import ALL, snap
from variant_store.cascade_meta import CascadeMeta

pytestmark = pytest.mark.unit

# edge-a -> core: round trip 2 x (5 + 20) ms; tiny at the edge-a (cpu-arm, 4 cores, 0.036 $/h) 1 ms; big at the
# core (4 GPUs, 14.4 $/h) 2 ms
RTT = 50.0
L1, L2 = 1.0, RTT + 2.0
C1, C2 = 1.0 / 1000 * 0.036 / 3600 / 4, 2.0 / 1000 * 14.4 / 3600 / 4


def cascade(escalation: float = 0.2, accuracy: float = 0.99, owner: str = "public",
            stages: tuple[str, ...] = ("tiny.int8", "big.fp32")) -> dict[str, dict[str, CascadeMeta]]:
    m = CascadeMeta(task="digits", cascade_id="c1", stages=stages, rule="max_softmax", thresholds=(0.9,),
                    accuracy=accuracy, escalation=(escalation,), target_accuracy=0.98, calibration_rows=200,
                    heldout_rows=200, owner=owner)
    return {"digits": {"c1": m}}


def decide(cascades: dict[str, dict[str, CascadeMeta]], **q: object) -> object:
    kw: dict[str, object] = {"tenant": "t1", "budget_ms": 200.0, "min_accuracy": 0.99, **q}
    return RoutingTable.build(snap(ALL), "edge-a", cascades=cascades).decide(Query("digits", **kw))  # type: ignore[arg-type]


def test_chosen_when_cheaper_with_its_expected_latency_cost_and_measured_accuracy() -> None:
    plain = RoutingTable.build(snap(ALL), "edge-a").decide(Query("digits", "t1", 200.0, 0.99))
    assert (plain.site, plain.variant_id) == ("core", "big.fp32")
    assert plain.cost == pytest.approx(C2)
    d = decide(cascade(0.2))
    assert isinstance(d, CascadeDecision) and d.plan is not None
    assert (d.site, d.variant_id, d.reason) == ("edge-a", "tiny.int8", "cascade")
    assert d.plan.sites == ("edge-a", "core") and d.plan.variants == ("tiny.int8", "big.fp32")
    assert d.expected_latency_ms == pytest.approx(L1 + 0.2 * L2)
    assert d.plan.escalated_ms == pytest.approx(L1 + L2)
    assert d.cost == pytest.approx(C1 + 0.2 * C2)
    assert d.accuracy == 0.99  # the cascade's measured accuracy, not either stage's
    assert d.feasible_count >= 2  # the plain candidates and the cascade


# (name, cascade kwargs, query kwargs): in each case the cascade is not chosen
NOT_CHOSEN: list[tuple[str, dict[str, object], dict[str, object]]] = [
    # its expected latency (1 + 0.2 x 52) fits 40 ms, its escalated path (53 ms) does not
    ("escalated path over budget", {}, {"budget_ms": 40.0}),
    ("accuracy below the floor", {"accuracy": 0.985}, {}),
    # escalating every row costs stage 1 on top of stage 2: dearer than stage 2 alone
    ("not cheaper", {"escalation": 1.0}, {}),
    # the expected cost fits, but an escalated query's would not
    ("cost ceiling on the escalated path", {}, {"max_cost": (C1 + 0.2 * C2 + C1 + C2) / 2}),
    ("another tenant's cascade", {"owner": "acme"}, {}),
    ("its last stage's site left out", {}, {"exclude_sites": frozenset({"core"})}),
]


@pytest.mark.parametrize(("name", "ckw", "qkw"), NOT_CHOSEN, ids=[c[0] for c in NOT_CHOSEN])
def test_not_chosen(name: str, ckw: dict[str, object], qkw: dict[str, object]) -> None:
    d = decide(cascade(**ckw), **qkw)  # type: ignore[arg-type]
    assert not isinstance(d, CascadeDecision), name


def test_feasible_cascade_serves_when_no_plain_candidate_fits() -> None:
    # 60 ms: the escalated path (53) fits; big at the core (52 ms) does too but the cascade is cheaper; at 52.5 ms
    # only big fits. At 55 ms with big's floor of accuracy 0.995 no plain candidate is accurate enough at all
    assert isinstance(decide(cascade(), budget_ms=60.0), CascadeDecision)
    assert not isinstance(decide(cascade(), budget_ms=52.5), CascadeDecision)
    d = decide(cascade(accuracy=0.999), budget_ms=55.0, min_accuracy=0.999, prefer="refuse")
    assert isinstance(d, CascadeDecision) and not d.best_effort


def test_stage_1_runs_at_the_door_or_the_cascade_is_not_a_candidate() -> None:
    """A cascade keeps the rows its small model is sure of off the WAN: with stage 1 only at mid (edge-a cannot load
    it), the plan mid -> core would be cheaper than big at the core alone, but every row would cross the WAN and the
    unsure ones twice (the demo's balanced class missed its budget that way)."""
    away = snap({"mid": {"cnn.fp32", "tiny.int8"}, "core": {"big.fp32", "acme.head"}},
                load_over={"edge-a": {"memory_free_bytes": 0}})
    table = RoutingTable.build(away, "edge-a", cascades=cascade())
    d = table.decide(Query("digits", "t1", 200.0, 0.99))
    assert not isinstance(d, CascadeDecision) and (d.site, d.variant_id) == ("core", "big.fp32")
    entries = cascade_entries(cascade()["digits"], table.candidates("digits").variant_id)
    kw = {"tenant": "t1", "min_accuracy": 0.99, "budget_ms": 200.0, "max_cost": None, "nbytes": 0, "rows": 1,
          "excluded": []}
    anywhere = plan_for(table._tasks["digits"], entries, **kw)  # type: ignore[arg-type]
    assert anywhere is not None and anywhere.sites == ("mid", "core") and anywhere.cost < d.cost
    assert plan_for(table._tasks["digits"], entries, first_at="edge-a", **kw) is None  # type: ignore[arg-type]


def test_a_cascade_naming_an_unknown_variant_is_left_out() -> None:
    d = decide(cascade(stages=("tiny.int8", "gone.fp32")))
    assert not isinstance(d, CascadeDecision)


def test_rows_are_billed_for_both_stages() -> None:
    one = decide(cascade())
    many = decide(cascade(), rows=8)
    assert isinstance(one, CascadeDecision) and isinstance(many, CascadeDecision)
    assert many.cost > one.cost and many.expected_latency_ms > one.expected_latency_ms


# (stage latencies, stage costs, escalation) -> (expected ms, escalated ms, expected cost, escalated cost)
COMBINE = [
    (([1.0], [10.0]), ([1.0], [2.0]), (0.5,), (6.0, 11.0, 2.0, 3.0)),
    (([1.0], [10.0], [100.0]), ([1.0], [2.0], [4.0]), (0.5, 0.1), (16.0, 111.0, 2.4, 7.0)),
    (([0.0], [0.0]), ([0.0], [5.0]), (0.0,), (0.0, 0.0, 0.0, 5.0)),
]


@pytest.mark.parametrize(("lat", "cost", "esc", "want"), COMBINE)
def test_combine(lat: tuple[list[float], ...], cost: tuple[list[float], ...], esc: tuple[float, ...],
                 want: tuple[float, float, float, float]) -> None:
    got = combine([np.array(x) for x in lat], [np.array(x) for x in cost], esc)
    assert [float(g.ravel()[0]) for g in got] == pytest.approx(list(want))


def test_combine_is_a_grid_over_sites_per_stage() -> None:
    exp_ms, esc_ms, _, _ = combine([np.array([1.0, 2.0]), np.array([10.0, 20.0, 30.0])],
                                   [np.zeros(2), np.zeros(3)], (0.5,))
    assert exp_ms.shape == (2, 3) and exp_ms[1, 2] == pytest.approx(2.0 + 15.0)
    assert esc_ms[0, 1] == pytest.approx(21.0)


def test_a_traced_decision_lists_the_chosen_cascade_beside_the_plain_candidates() -> None:
    table = RoutingTable.build(snap(ALL), "edge-a", cascades=cascade())
    q = Query("digits", "t1", 200.0, 0.99)
    d = table.decide(q)
    cands = explain(table, q, d)
    last = cands[-1]
    assert last.variant == "cascade:c1:tiny.int8>big.fp32@core" and last.site == "edge-a" and last.feasible
    assert last.latency_ms == pytest.approx(d.expected_latency_ms) and last.cost == pytest.approx(d.cost)
    assert any(c.variant == "big.fp32" and c.site == "core" and c.feasible for c in cands[:-1])


def test_a_later_stage_runs_only_where_its_variant_is_loaded() -> None:
    """An escalation is pinned to its (site, variant): a cold one there may not even be readable (a tenant's private
    variant reaches only the sites placement gave it), so stage 2 is a candidate only where it is loaded."""
    table = RoutingTable.build(snap({"edge-a": {"tiny.int8"}, "core": {"acme.head"}}), "edge-a", cascades=cascade())
    entries = cascade_entries(cascade()["digits"], table.candidates("digits").variant_id)
    kw = {"tenant": "t1", "min_accuracy": 0.99, "budget_ms": 60_000.0, "max_cost": None, "nbytes": 0, "rows": 1,
          "excluded": [], "first_at": "edge-a"}
    assert plan_for(table._tasks["digits"], entries, **kw) is None  # type: ignore[arg-type]
    loaded = RoutingTable.build(snap({"edge-a": {"tiny.int8"}, "core": {"big.fp32"}}), "edge-a", cascades=cascade())
    entries = cascade_entries(cascade()["digits"], loaded.candidates("digits").variant_id)
    plan = plan_for(loaded._tasks["digits"], entries, **kw)  # type: ignore[arg-type]
    assert plan is not None and plan.sites == ("edge-a", "core")
