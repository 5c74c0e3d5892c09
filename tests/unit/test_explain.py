"""Decision explanations (traces): every visible candidate, the first filter each failed, in agreement
with ``decide()``; another tenant's private variants never appear."""

from __future__ import annotations

import pytest

from core_scheduler.policy.explain import explain
from core_scheduler.policy.routing import Query, RoutingTable
from tests.unit.test_routing import ALL, snap

pytestmark = pytest.mark.unit


def _table(**kw: object) -> RoutingTable:
    return RoutingTable.build(snap(ALL, **kw), "edge-a")  # type: ignore[arg-type]


@pytest.mark.parametrize("q", [
    Query("digits", min_accuracy=0.95, budget_ms=100.0),
    Query("digits", min_accuracy=0.98, budget_ms=100.0),
    Query("digits", min_accuracy=0.99, budget_ms=30.0),      # nothing feasible: best effort
    Query("digits", tenant="acme", min_accuracy=0.99, budget_ms=1000.0),
    Query("digits", min_accuracy=0.9, budget_ms=100.0, max_cost=1e-9),
    Query("digits", min_accuracy=0.9, budget_ms=100.0, exclude_sites=frozenset({"edge-a"}), nbytes=50_000),
])
def test_explanation_agrees_with_the_decision(q: Query) -> None:
    table = _table()
    d = table.decide(q)
    cands = explain(table, q, d)
    assert cands and sum(c.feasible for c in cands) == d.feasible_count
    chosen = [c for c in cands if (c.site, c.variant) == (d.site, d.variant_id)]
    assert len(chosen) == 1 and chosen[0].feasible == (not d.best_effort)
    for c in cands:
        assert c.feasible == (c.why_not is None)
        if c.feasible:  # the decision takes the cheapest feasible
            assert c.cost >= d.cost - 1e-12
    if not d.best_effort:  # the terms add up to what routing expected of the choice
        c = chosen[0]
        assert c.network_ms + c.queue_ms + c.compute_ms + c.load_ms == pytest.approx(d.expected_latency_ms)


def test_why_not_names_the_first_failed_filter() -> None:
    table = _table(site_over={"mid": {"alive": False}})
    q = Query("digits", min_accuracy=0.98, budget_ms=40.0, exclude_sites=frozenset({"edge-b"}))
    why = {(c.site, c.variant): c.why_not for c in explain(table, q)}
    assert why[("edge-a", "tiny.int8")] == "accuracy"
    assert why[("edge-a", "big.fp32")] == "no_profile"  # no profile on cpu-arm
    assert why[("mid", "cnn.fp32")] == "unavailable"    # not live
    assert why[("edge-b", "cnn.fp32")] == "excluded"
    assert why[("core", "big.fp32")] == "latency"       # 50 ms round trip > 40 ms
    # acme's private head is not shown to the public tenant, but is to acme
    assert not any(v == "acme.head" for _, v in why)
    assert any(c.variant == "acme.head" for c in explain(table, Query("digits", tenant="acme")))


def test_bounded_and_the_choice_kept() -> None:
    table = _table()
    q = Query("digits", min_accuracy=0.99, budget_ms=1000.0)
    d = table.decide(q)
    few = explain(table, q, d, limit=2)
    assert len(few) == 2 and (few[-1].site, few[-1].variant) == (d.site, d.variant_id)
    assert explain(object(), q) == [] and explain(table, Query("nope")) == []
    assert all(isinstance(v, (str, float, bool, type(None))) for c in few for v in c.to_json().values())


def test_a_trace_shows_each_candidates_real_cost_and_latency() -> None:
    """A query costs millionths of a dollar on these sites: rounded to 4 decimals every candidate's cost was 0.0
    in a trace, which then could not show why a site won. Its total expected latency is in the trace too."""
    table = _table()
    q = Query("digits", min_accuracy=0.95, budget_ms=100.0)
    d = table.decide(q)
    cands = explain(table, q, d)
    shown = [c.to_json() for c in cands]
    priced = [(c, j) for c, j in zip(cands, shown, strict=True) if c.feasible]
    assert len(priced) >= 2 and all(0 < c.cost < 1e-4 for c, _ in priced)  # what made the 0.0
    for c, j in priced:
        assert j["cost"] == pytest.approx(c.cost, rel=1e-3)
        assert j["latency_ms"] == pytest.approx(c.network_ms + c.queue_ms + c.compute_ms + c.load_ms, abs=1e-3)
    assert len({j["cost"] for _, j in priced}) > 1  # they differ, as routing saw them
    chosen = next(j for j in shown if (j["site"], j["variant"]) == (d.site, d.variant_id))
    assert chosen["latency_ms"] == pytest.approx(d.expected_latency_ms, abs=1e-3)
