"""Why a routing decision went the way it did: every candidate a query's tenant may see, with the cost
model's terms and, for each one that was not feasible, the first filter it failed.

Only traced queries pay for this (``decide()`` itself never builds it). A pure function over the
routing table's candidate arrays (:mod:`core_scheduler.policy.routing_candidates`), in the same units.

``why_not`` codes, in the order they are checked (the first that applies is given):

    excluded       left out of this decision (a failed attempt, or a peer the transport marked unreachable)
    unreachable    no network path from here
    no_profile     the variant has no profile for the site's hardware
    unavailable    the site is not live, or has no memory to load the variant
    no_capacity    the site is at its in-flight capacity or degraded
    accuracy       below the query's minimum accuracy
    cost           above the query's cost ceiling
    latency        the expected latency exceeds the budget left

A decision for a cascade (issue 33) adds the chosen cascade as a candidate of its own, after the plain ones: its
``site`` stage 1's, its ``variant`` ``cascade:<id>:<stage 1>><last stage>@<last stage's site>``, its
``latency_ms`` and ``cost`` the expected ones it was ranked by (``compute_ms``: its escalated path's whole latency,
the one judged against the budget; the other terms 0).

``estimated``: the candidate's compute and load come from another hardware class's profile scaled to this one
(``core_scheduler.policy.snapshot.with_estimates``: the site has not measured the variant yet), not a measurement.

Candidates of variants the tenant may not use are left out altogether: a trace never names another
tenant's private variant. A non-finite term (an unreachable site's round trip) is written as -1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core_scheduler.policy.routing import CascadeDecision, Decision, Query, RoutingTable

__all__ = ["MAX_CANDIDATES", "Candidate", "explain"]

MAX_CANDIDATES = 32  # per hop record: the cheapest ones, and always the chosen one


@dataclass(frozen=True, slots=True)
class Candidate:
    site: str
    variant: str
    network_ms: float   # round trip + tail margin + transfer of the request
    queue_ms: float
    compute_ms: float
    load_ms: float      # cold start (load + blob fetch); 0 when loaded
    latency_ms: float   # what routing expects in all: network + queue + compute + load, judged against the budget
    cost: float         # dollars per query (routing_candidates): millionths of a dollar on a CPU site
    feasible: bool
    why_not: str | None
    estimated: bool = False  # the variant's timings on the site's class are an estimate, not a measurement

    def to_json(self) -> dict[str, object]:
        return {"site": self.site, "variant": self.variant, "network_ms": _ms(self.network_ms),
                "queue_ms": _ms(self.queue_ms), "compute_ms": _ms(self.compute_ms), "load_ms": _ms(self.load_ms),
                "latency_ms": _ms(self.latency_ms), "cost": _dollars(self.cost), "feasible": self.feasible,
                "why_not": self.why_not, "estimated": self.estimated}


def _ms(x: float) -> float:
    return round(x, 4) if math.isfinite(x) else -1.0


def _dollars(x: float) -> float:
    # significant figures, not decimals: a query costs ~1e-7 $ on a CPU site, which 4 decimals made 0.0 for every
    # candidate, so a trace could not show the cost that decided between them
    return float(f"{x:.4g}") if math.isfinite(x) else -1.0


def explain(router: object, q: Query, chosen: Decision | None = None,
            limit: int = MAX_CANDIDATES) -> list[Candidate]:
    """The candidates of ``q`` at ``router`` (a :class:`RoutingTable`; other routers, the baselines, have no
    candidate table: empty), cheapest first, at most ``limit``, the chosen one always among them."""
    if not isinstance(router, RoutingTable) or q.task not in router.tasks():
        return []
    a = router.candidates(q.task)
    visible = [i for i, owner in enumerate(a.owner) if owner in ("public", q.tenant)]
    budget = min(q.budget_ms, 1e300)
    out: list[Candidate] = []
    for i in visible:
        site, variant = a.site[i], a.variant_id[i]
        rtt = float(a.rtt_ms[i])
        transfer = float(a.per_byte_ms[i]) * q.nbytes
        queue, compute, load = float(a.queue_ms[i]), float(a.compute_ms[i]), float(a.load_ms[i])
        base = float(a.base_ms[i])
        latency = base + transfer
        # base = rtt + margin + queue + compute + load: the network share is what is left of it
        network = latency - queue - compute - load if math.isfinite(base) else math.inf
        cost = float(a.cost[i])
        why: str | None = None
        if site in q.exclude_sites:
            why = "excluded"
        elif not math.isfinite(rtt):
            why = "unreachable"
        elif not math.isfinite(cost):
            why = "no_profile"
        elif not a.hard_ok[i]:
            why = "unavailable"
        elif not a.capacity_ok[i]:
            why = "no_capacity"
        elif float(a.accuracy[i]) < q.min_accuracy:
            why = "accuracy"
        elif q.max_cost is not None and cost > q.max_cost:
            why = "cost"
        elif not latency <= budget:
            why = "latency"
        est = bool(a.estimated[i]) if len(a.estimated) > i else False
        out.append(Candidate(site, variant, network, queue, compute, load, latency, cost, why is None, why, est))
    if len(out) > limit:
        keep = out[:limit]
        if chosen is not None and not any(c.site == chosen.site and c.variant == chosen.variant_id for c in keep):
            pick = next((c for c in out if c.site == chosen.site and c.variant == chosen.variant_id), None)
            if pick is not None:
                keep[-1] = pick
        out = keep
    if isinstance(chosen, CascadeDecision) and chosen.plan is not None:
        p = chosen.plan
        name = f"cascade:{p.cascade_id}:{p.variants[0]}>{p.variants[-1]}@{p.sites[-1]}"
        out.append(Candidate(p.sites[0], name[:128], 0.0, 0.0, p.escalated_ms, 0.0, p.expected_ms, p.cost, True, None))
    return out
