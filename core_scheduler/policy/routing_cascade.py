"""Cascades as routing candidates (issue 33): a calibrated cascade (``variant_store.cascade_meta``) is one more
way to serve a task, beside its plain (site, variant) candidates, and :mod:`core_scheduler.policy.routing`
chooses it when it is the cheapest feasible one.

The door runs a cascade (``edge_agent.cascade_exec``): it sends the query to stage 1 at site ``S1``, and the rows
stage 1 is unsure of to stage 2 at ``S2`` (and so on), each as a normal query pinned to its (site, variant). So
each stage's latency is its plain candidate's, from the door (round trip + margin + transfer + queue + compute +
cold start, :mod:`core_scheduler.policy.routing_candidates`); when stage 1 runs at the door, as is typical, the
escalation's path from the door is the path S1 -> S2. For stages ``L1 .. Ln``, escalation rates ``e1 .. e(n-1)``
(the share of held-out rows reaching stage ``k + 1``, measured by the store), and per-stage costs ``C1 .. Cn``::

    expected latency  = L1 + e1 x L2 + ... + e(n-1) x Ln      what ranks it among candidates of equal cost
    escalated latency = L1 + L2 + ... + Ln                    what must fit the budget: a cascade is feasible
                                                              only if its slowest path does, so no escalated
                                                              query misses its SLO by design
    cost              = C1 + e1 x C2 + ... + e(n-1) x Cn      dollars per query, as routing bills variants
    cost ceiling      judged on C1 + ... + Cn                 (an escalated query must not pass it either)
    accuracy          = the cascade's measured held-out accuracy (the SLO's ``min_accuracy`` is judged on it)

A stage's candidates are those of its variant where routing's hard and capacity filters pass and the tenant may
use it (``TaskTable.masked_base`` at accuracy floor 0: stage 1 is the small, less accurate variant by design).
Stage 1 runs where the query is (``first_at``, the door): a cascade exists to keep the rows its small model is sure
of off the WAN. A first stage elsewhere sends every row over the WAN and the unsure ones twice, and was chosen only
because a small variant at a cheap site costs less: in the demo (issue 30) the balanced class (60 ms) at edge-fra-1
and edge-par-1 ran stage 1 at core-eu, 32-34 ms away, and stage 2 at mid-eu; its stage-1 answers took 48-57 ms, its
escalated ones 50-57 ms, and 3-7 % of the class missed its budget where plain routing to mid-eu met it.
Every combination of one site per stage is weighed; a cascade has at most ``MAX_STAGES`` stages and a task a
handful of sites per variant, so that is a few hundred sums per query, and only for tasks that have cascades.

Pure: arrays and catalog entries in, a plan out; no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from core_scheduler.policy.routing_candidates import TaskTable
from variant_store.cascade_meta import CascadeMeta
from variant_store.meta import PUBLIC

__all__ = ["CascadeEntry", "CascadePlan", "best_cascade", "cascade_entries", "combine", "plan_for"]


@dataclass(frozen=True, slots=True)
class CascadePlan:
    """A chosen cascade: each stage's variant and site, and the cost model's figures for it."""

    cascade_id: str
    rule: str
    thresholds: tuple[float, ...]
    variants: tuple[str, ...]
    sites: tuple[str, ...]
    stage_ms: tuple[float, ...]   # each stage's expected latency from the door
    expected_ms: float
    escalated_ms: float
    cost: float
    accuracy: float
    escalation: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class CascadeEntry:
    """A cascade of a task and, per stage, the positions of its variant's candidates in the task's arrays."""

    meta: CascadeMeta
    stage_idx: tuple[NDArray[np.int64], ...]


def cascade_entries(cascades: Mapping[str, CascadeMeta], variant_ids: tuple[str, ...]) -> tuple[CascadeEntry, ...]:
    """The cascades of one task that routing can weigh: those whose every stage is a variant with candidates
    (a cascade naming a variant the catalog no longer has is left out, not an error: the catalog moves)."""
    ids = np.array(variant_ids, dtype=object)
    out: list[CascadeEntry] = []
    for cid in sorted(cascades):
        meta = cascades[cid]
        idx = tuple(np.flatnonzero(ids == v).astype(np.int64) for v in meta.stages)
        if all(len(i) for i in idx):
            out.append(CascadeEntry(meta, idx))
    return tuple(out)


def combine(lat: list[NDArray[np.float64]], cost: list[NDArray[np.float64]],
            escalation: tuple[float, ...]) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64],
                                                    NDArray[np.float64]]:
    """Over every combination of one candidate per stage (an n-dimensional grid, stage ``k`` on axis ``k``):
    expected latency, escalated latency, expected cost and escalated cost, by the module docstring's formulas."""
    n = len(lat)

    def axis(a: NDArray[np.float64], k: int) -> NDArray[np.float64]:
        return a.reshape([-1 if j == k else 1 for j in range(n)])

    weights = (1.0, *escalation)
    exp_ms = sum((w * axis(a, k) for k, (w, a) in enumerate(zip(weights, lat, strict=True))), np.zeros([1] * n))
    esc_ms = sum((axis(a, k) for k, a in enumerate(lat)), np.zeros([1] * n))
    exp_cost = sum((w * axis(a, k) for k, (w, a) in enumerate(zip(weights, cost, strict=True))), np.zeros([1] * n))
    esc_cost = sum((axis(a, k) for k, a in enumerate(cost)), np.zeros([1] * n))
    return (np.asarray(exp_ms, dtype=np.float64), np.asarray(esc_ms, dtype=np.float64),
            np.asarray(exp_cost, dtype=np.float64), np.asarray(esc_cost, dtype=np.float64))


def best_cascade(entries: tuple[CascadeEntry, ...], *, tenant: str, min_accuracy: float, budget_ms: float,
                 max_cost: float | None, lat: NDArray[np.float64], cost: NDArray[np.float64],
                 sites: tuple[str, ...], first_at: str | None = None) -> CascadePlan | None:
    """The cheapest feasible cascade plan (ties by expected latency), None when none is feasible.

    ``lat``: every candidate's latency for this query (inf where a filter fails: hard, capacity, tenant, an
    excluded site); ``cost``: every candidate's cost for this query's rows; ``sites``: each candidate's site;
    ``first_at``: the site stage 1 must run at (the door; None: any)."""
    best: tuple[float, float] | None = None
    plan: CascadePlan | None = None
    budget = min(budget_ms, 1e300)  # an infinite budget must not admit masked (inf) candidates
    for e in entries:
        m = e.meta
        if m.owner not in (PUBLIC, tenant) or m.accuracy < min_accuracy:
            continue
        stage_lat = [lat[i] for i in e.stage_idx]
        if first_at is not None:
            at_door = np.array([sites[i] == first_at for i in e.stage_idx[0]], dtype=bool)
            stage_lat[0] = np.where(at_door, stage_lat[0], np.inf)
        stage_cost = [cost[i] for i in e.stage_idx]
        exp_ms, esc_ms, exp_cost, esc_cost = combine(stage_lat, stage_cost, m.escalation)
        ok = esc_ms <= budget
        if max_cost is not None:
            ok &= esc_cost <= max_cost
        if not ok.any():
            continue
        keys = np.where(ok, exp_cost, np.inf)
        low = keys.min()
        pick = np.where(ok & (keys <= low), exp_ms, np.inf)
        at = np.unravel_index(int(pick.argmin()), pick.shape)
        key = (float(exp_cost[at]), float(exp_ms[at]))
        if best is not None and key >= best:
            continue
        best = key
        chosen = [int(e.stage_idx[k][j]) for k, j in enumerate(at)]
        plan = CascadePlan(cascade_id=m.cascade_id, rule=m.rule, thresholds=m.thresholds, variants=m.stages,
                           sites=tuple(sites[i] for i in chosen), stage_ms=tuple(float(lat[i]) for i in chosen),
                           expected_ms=key[1], escalated_ms=float(esc_ms[at]), cost=key[0], accuracy=m.accuracy,
                           escalation=m.escalation)
    return plan


def plan_for(t: TaskTable, entries: tuple[CascadeEntry, ...], *, tenant: str, min_accuracy: float, budget_ms: float,
             max_cost: float | None, nbytes: int, rows: int, excluded: list[int],
             first_at: str | None = None) -> CascadePlan | None:
    """:func:`best_cascade` for one query over a task's table: its candidates' latency with the query's own
    terms (transfer, rows), inf where a filter fails or the site is ``excluded`` (site positions); their cost
    for its rows; stage 1 at ``first_at``."""
    lat = t.masked_base(tenant, 0.0)
    extra = t.request_ms(nbytes, rows)
    if extra is not None:
        lat = lat + extra
    for pos in excluded:
        lat = np.where(t.arr.site_idx == pos, np.inf, lat)
    # a later stage only where its variant is loaded: an escalation is pinned to its (site, variant), and a cold
    # one there may not even be readable (a tenant's private variant is fetched only by a site placement gave it:
    # tests/system/test_text_mesh.py saw "mid-eu may not fetch topic-minilm-l6-int8" for stage 2); stage 1 runs
    # at the door, which loads what it is asked to serve
    later = np.zeros(len(lat), dtype=bool)
    for e in entries:
        for idx in e.stage_idx[1:]:
            later[idx] = True
    lat = np.where(later & ~t.arr.loaded, np.inf, lat)
    cost = t.cost_of(rows) if rows > 1 else t.arr.cost
    return best_cascade(entries, tenant=tenant, min_accuracy=min_accuracy, budget_ms=budget_ms, max_cost=max_cost,
                        lat=lat, cost=cost, sites=t.arr.site, first_at=first_at)
