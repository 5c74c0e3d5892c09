"""Per-query routing: which (site, variant) serves a query, by the DESIGN.md cost model.

A :class:`RoutingTable` is built once per (snapshot, here-site) when state changes; ``decide()``
then costs a handful of numpy operations over per-task candidate arrays.

Per candidate (site ``s``, variant ``v`` of the task) the cost model gives an expected latency
(round trip + transfer + queue + compute at the likely batch + load time if cold) and a dollar
cost per query; its terms are built in :mod:`core_scheduler.policy.routing_candidates`, whose
docstring spells them out. This module holds the query, the decision and the choice among the
candidates.

Filters. *Hard* (never served otherwise): site alive and reachable, variant profiled on the
site's hardware, enough free memory to load it if cold, tenant may use it (owner public or the
tenant), site not in ``exclude_sites``. *Soft* (the SLO, relaxed only by best effort):
latency <= budget, accuracy >= min_accuracy, site has capacity (inflight < capacity, not
degraded), cost <= max_cost.

Choice: least cost among feasible candidates, ties by lower latency, then the local site.
None feasible: ``prefer="latency"`` takes the lowest-latency candidate meeting the accuracy
floor (else the lowest latency overall); ``"accuracy"`` the most accurate candidate whose expected
latency fits the remaining budget (ties by latency), else, when nothing fits it, the most accurate
variant loaded at this site (no network, no cold start), else the lowest-latency candidate. A
variant that cannot arrive in time is no answer at all: the most accurate one anywhere, chosen
regardless of its latency, came back ``504 deadline`` from across the WAN. Both prefer sites with
capacity and are flagged ``best_effort``; the data plane gives a best-effort query a bounded grace
past its deadline (``mesh.types.BEST_EFFORT_GRACE_MS``). ``"refuse"`` answers by why nothing fits:

    ImpossibleSLO (422)     no variant at any site could meet the SLO *as asked*: judged on the whole
                            budget the caller asked for (``Query.slo_ms``) against each candidate's floor
                            (round trip + margin + warm compute, no queue, no cold start, whatever the
                            sites' state), with the accuracy floor, tenant and cost ceiling. It names the
                            best latency and accuracy on offer. A promise: asking again will not help.
    DeadlineExceeded (504)  the SLO is one the mesh can meet, and could now on its whole budget, but the
                            query lost that budget before or while routing (queued at a busy door, a
                            failed attempt): the query is late, not impossible.
    Overloaded (503)        the SLO is one the mesh can meet, but not now even on its whole budget (queues,
                            capacity, cold starts, sites down or left out).

A query that asked for best effort (``prefer`` latency or accuracy) is served best effort instead in every
case above; only an impossible SLO with ``"refuse"`` is a 422 (issue 30: a query that asked 150 ms and
lost 100 ms inside a busy edge was refused as impossible).

Reason codes (``Decision.reason``):

    local                 feasible, served at this site by a loaded variant
    forward               feasible, served at another site by a loaded variant
    cold_start            feasible, but the chosen variant must be loaded first (anywhere)
    best_effort_latency   nothing feasible; lowest latency chosen (prefer="latency")
    best_effort_accuracy  nothing feasible; highest accuracy chosen (prefer="accuracy")
    cascade               a calibrated cascade (:mod:`core_scheduler.policy.routing_cascade`) is the cheapest
                          feasible candidate, or the only one: a :class:`CascadeDecision` (the door answers
                          ``cascade_local`` or ``cascade_escalated``, ``edge_agent.cascade_exec``)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import numpy as np
from numpy.typing import NDArray

from core_scheduler.policy.routing_candidates import (
    CandidateArrays,
    TaskTable,
    TaskTables,
    any_true,
)
from core_scheduler.policy.routing_cascade import CascadeEntry, CascadePlan, cascade_entries, plan_for
from core_scheduler.policy.snapshot import MeshSnapshot
from core_scheduler.policy.versions import VersionTables, pick_version, version_tables
from mesh.errors import ConfigError, DeadlineExceeded, ImpossibleSLO, MeshError, NoRoute, Overloaded, UnknownTask
from mesh.types import DEFAULT_PREFER, DEFAULT_TENANT, SLO, Prefer
from variant_store.cascade_meta import CascadeMeta

__all__ = ["REASONS", "CascadeDecision", "Decision", "Query", "RoutingTable"]

REASONS = ("local", "forward", "cold_start", "best_effort_latency", "best_effort_accuracy", "cascade")
_INF = np.inf


@dataclass(frozen=True, slots=True)
class Query:
    task: str
    tenant: str = DEFAULT_TENANT
    budget_ms: float = float("inf")  # remaining, from this hop
    min_accuracy: float = 0.0
    max_cost: float | None = None
    prefer: Prefer = DEFAULT_PREFER
    nbytes: int = 0
    exclude_sites: frozenset[str] = frozenset()
    rows: int = 1  # the request's batch: its compute is the profile's at the batch it makes
    # the whole budget the caller asked for (the SLO's latency_ms), by which an SLO is judged impossible;
    # None: ``budget_ms`` (a query that has lost none of it)
    slo_ms: float | None = None
    version: int | None = None  # a pinned version of the task (issue 34 item 3); None: drawn by the split

    @classmethod
    def from_slo(cls, task: str, tenant: str, slo: SLO, remaining_ms: float, nbytes: int = 0,
                 exclude_sites: frozenset[str] = frozenset(), rows: int = 1, version: int | None = None) -> Query:
        """The query a hop routes for a request with ``slo`` and ``remaining_ms`` of its budget
        left: the one way the data plane builds a ``Query``."""
        return cls(task=task, tenant=tenant, budget_ms=remaining_ms, min_accuracy=slo.min_accuracy,
                   max_cost=slo.max_cost, prefer=slo.prefer, nbytes=nbytes, exclude_sites=exclude_sites,
                   rows=rows, slo_ms=slo.latency_ms, version=version)

    @property
    def full_ms(self) -> float:
        """The budget an SLO is judged impossible by: the one asked for, never less than what is left."""
        return self.budget_ms if self.slo_ms is None else max(self.slo_ms, self.budget_ms)


@dataclass(frozen=True, slots=True)
class Decision:
    site: str
    variant_id: str
    reason: str
    expected_latency_ms: float
    cost: float
    accuracy: float
    best_effort: bool
    feasible_count: int
    # the chosen variant's timings on its site's class are an estimate, not a measurement (snapshot.with_estimates)
    estimated: bool = False


@dataclass(frozen=True, slots=True)
class CascadeDecision(Decision):
    """A decision to serve by a cascade: ``site`` and ``variant_id`` are stage 1's, ``plan`` every stage's."""

    plan: CascadePlan | None = None


class RoutingTable:
    """Routing decisions at site ``here`` over one snapshot. Cheap to query, rebuilt on change."""

    __slots__ = ("_cascades", "_rng", "_site_pos", "_tasks", "_versions", "here", "version")

    def __init__(self, here: str, version: int, tasks: Mapping[str, TaskTable],
                 site_pos: Mapping[str, int], cascades: Mapping[str, tuple[CascadeEntry, ...]] | None = None,
                 versions: VersionTables | None = None,
                 seed: int | None = None) -> None:
        self.here = here
        self.version = version
        self._tasks = tasks if isinstance(tasks, TaskTables) else dict(tasks)  # TaskTables: built as asked
        self._site_pos = dict(site_pos)
        self._cascades = {task: c for task, c in (cascades or {}).items() if c and task in self._tasks}
        # task -> (each version's share, its candidates alone): only tasks with more than one version catalogued
        self._versions = dict(versions or {})
        self._rng = random.Random(seed)

    @classmethod
    def build(cls, snap: MeshSnapshot, here: str, cascades: Mapping[str, Mapping[str, CascadeMeta]] | None = None,
              seed: int | None = None) -> RoutingTable:
        """``cascades``: task -> cascade id -> catalog entry; None: the snapshot's (its ``cascades`` field, read
        with getattr until the store's half of issue 33 adds it to ``MeshSnapshot``)."""
        if here not in snap.site_index:
            raise ConfigError(f"routing site {here!r} is not in the topology")
        tasks = TaskTables(snap, here)
        found = snap.cascades if cascades is None else cascades
        entries = {task: cascade_entries(by_id, tasks[task].arr.variant_id)
                   for task, by_id in (found or {}).items() if task in tasks}
        return cls(here, snap.version, tasks, snap.site_index, entries, version_tables(snap, here, tasks), seed)

    def tasks(self) -> tuple[str, ...]:
        return tuple(sorted(self._tasks))

    def candidates(self, task: str) -> CandidateArrays:
        return self._table(task).arr

    def _table(self, task: str) -> TaskTable:
        t = self._tasks.get(task)
        if t is None:
            raise UnknownTask(f"no variant of task {task!r} is registered", task=task)
        return t

    def decide(self, q: Query) -> Decision:
        if (self._versions or q.version is not None) and (q.task in self._versions or q.version is not None):
            return self._decide_version(q)
        if self._cascades and q.task in self._cascades:
            return self._decide_cascades(q, self._cascades[q.task])
        return self._decide_plain(q)

    def _decide_version(self, q: Query) -> Decision:
        """``decide()`` among the candidates of one version of the task: the pinned one, else one drawn by share
        (``core_scheduler.policy.versions``). A task with one version (1) answers a pin of 1 as it always did."""
        t = self._table(q.task)
        if not t.tenant_access(q.tenant)[1]:  # another tenant's task: unknown, whatever the pin
            return self._decide_plain(q)
        shares, tables = self._versions.get(q.task) or ({1: 1.0}, {1: t})
        pick = pick_version(q.task, shares, q.version, self._rng.random())
        return self._decide_plain(q, tables[pick])

    def _decide_cascades(self, q: Query, entries: tuple[CascadeEntry, ...]) -> Decision:
        """``decide()`` for a task with cascades: the cheapest feasible of the plain decision and the task's
        cascades (the plain one on a tie: a cascade must be cheaper to be worth its escalations)."""
        try:
            plain: Decision | None = self._decide_plain(q)
            error: MeshError | None = None
        except MeshError as exc:  # nothing plain at all (refused, or no route): a cascade may still serve it
            plain, error = None, exc
        t = self._tasks[q.task]
        if not t.tenant_access(q.tenant)[1]:  # decide() refused it as an unknown task: so is every cascade
            assert error is not None
            raise error
        plan = plan_for(t, entries, tenant=q.tenant, min_accuracy=q.min_accuracy, budget_ms=q.budget_ms,
                        max_cost=q.max_cost, nbytes=q.nbytes, rows=q.rows,
                        excluded=[self._site_pos[s] for s in q.exclude_sites if s in self._site_pos],
                        first_at=self.here)
        if plan is None or (plain is not None and not plain.best_effort and plain.cost <= plan.cost):
            if error is not None:
                raise error
            assert plain is not None
            return plain
        count = (plain.feasible_count if plain is not None and not plain.best_effort else 0) + 1
        return CascadeDecision(plan.sites[0], plan.variants[0], "cascade", plan.expected_ms, plan.cost,
                               plan.accuracy, False, count, False, plan)

    def _decide_plain(self, q: Query, table: TaskTable | None = None) -> Decision:
        t = table if table is not None else self._tasks.get(q.task)
        if t is None:
            raise UnknownTask(f"no variant of task {q.task!r} is registered", task=q.task)
        # a cached masked base implies the tenant was visible when it was made, and visibility
        # is fixed per table: the hit skips the visibility lookups
        base = t.masked.get((q.tenant, q.min_accuracy))
        if base is None:
            if not t.tenant_access(q.tenant)[1]:
                raise UnknownTask(f"no variant of task {q.task!r} is visible to tenant {q.tenant!r}",
                                  task=q.task)
            base = t.masked_base(q.tenant, q.min_accuracy)
        if q.rows > 1 and t.n:
            return self._decide_rows(t, q, base)
        if q.max_cost is not None or q.exclude_sites or not t.n:
            return self._decide_restricted(t, q, base)
        # the common query: no cost ceiling, no exclusions; as _decide_restricted with n == t.n
        nbytes = q.nbytes
        budget = q.budget_ms
        if 1e300 < budget:  # min(budget, 1e300): an infinite budget must not admit masked (inf)
            budget = 1e300
        if nbytes:
            tx = t.transfer.get(nbytes)
            if tx is None:
                tx = t.transfer_ms(nbytes)
            lat = tx + base
        else:
            lat = base
        ok = lat <= budget
        i = int(ok.argmax())
        if not ok[i]:
            return self._best_effort(t, q)
        if nbytes:
            # an equal-cost run is sorted by static latency; only the transfer term can reorder it,
            # and every entry below lat[i] is feasible too
            end = t.tie_end_l[i]
            if end - i > 1:
                i += int(lat[i:end].argmin())
        return _decision(t.arr.site[i], t.arr.variant_id[i], t.reason[i], lat.item(i), t.cost[i],
                         t.accuracy[i], False, int(np.count_nonzero(ok)), t.estimated[i])

    def _decide_rows(self, t: TaskTable, q: Query, base: NDArray[np.float64]) -> Decision:
        """``decide()`` for a request of several rows: its latency and its cost are those of its rows (the
        table's order, by one-row cost, no longer holds), so the choice is a sort of the feasible ones."""
        a = t.arr
        extra = t.request_ms(q.nbytes, q.rows)
        lat = base if extra is None else base + extra
        ok = lat <= min(q.budget_ms, 1e300)
        cost = t.cost_of(q.rows)
        if q.max_cost is not None:
            ok &= cost <= q.max_cost
        for name in q.exclude_sites:
            pos = self._site_pos.get(name)
            if pos is not None:
                ok &= a.site_idx != pos
        feasible = np.flatnonzero(ok)
        if not len(feasible):
            return self._best_effort(t, q)
        # least cost, then lowest latency; lexsort is stable, so equal keys keep the table's order
        i = int(feasible[np.lexsort((lat[feasible], cost[feasible]))[0]])
        return _decision(a.site[i], a.variant_id[i], t.reason[i], lat.item(i), cost.item(i), t.accuracy[i], False,
                         len(feasible), t.estimated[i])

    def _decide_restricted(self, t: TaskTable, q: Query, base: NDArray[np.float64]) -> Decision:
        """``decide()`` under a cost ceiling or site exclusions."""
        a = t.arr
        # sorted by cost, so a cost ceiling is a prefix
        n = t.n if q.max_cost is None else int(np.searchsorted(a.cost, q.max_cost, side="right"))
        if n:
            if n != t.n:
                base = base[:n]
            extra = t.request_ms(q.nbytes, q.rows)
            lat = base if extra is None else base + (extra if n == t.n else extra[:n])
            # an infinite budget must not admit masked (inf) candidates
            ok = lat <= min(q.budget_ms, 1e300)
            for name in q.exclude_sites:
                pos = self._site_pos.get(name)
                if pos is not None:
                    ok &= (a.site_idx if n == t.n else a.site_idx[:n]) != pos
            i = int(ok.argmax())
            if ok[i]:
                end = min(t.tie_end_l[i], n)
                # an equal-cost run is sorted by static latency; only the per-request terms can
                # reorder it. Without exclusions every entry below lat[i] is feasible too.
                if end - i > 1 and (q.nbytes or q.rows > 1):
                    if q.exclude_sites:
                        i += int(np.where(ok[i:end], lat[i:end], _INF).argmin())
                    else:
                        i += int(lat[i:end].argmin())
                return _decision(a.site[i], a.variant_id[i], t.reason[i], lat.item(i), t.cost[i],
                                 t.accuracy[i], False, int(np.count_nonzero(ok)), t.estimated[i])
        return self._best_effort(t, q)

    def _best_effort(self, t: TaskTable, q: Query) -> Decision:
        if q.exclude_sites or q.prefer != "latency":
            # "accuracy" depends on the budget (what fits it), so it is not cached per pool
            return self._best_effort_full(t, q)
        # without exclusions the chosen pool depends on (tenant, accuracy floor, prefer) only:
        # cache it as a masked base so a query costs one transfer term and an argmin
        key = (q.tenant, q.min_accuracy, q.prefer)
        hit = t.best.get(key)
        if hit is None:
            hit = t.best.put(key, self._best_effort_pool(t, q))
        base, reason = hit
        a = t.arr
        extra = t.request_ms(q.nbytes, q.rows)
        if extra is not None:
            lat = extra + base  # inf + a finite term stays inf: masked stay out
            i = int(lat.argmin())
            # from the unmasked terms, as a.latency_ms() has it (should every pick be inf)
            latency = a.base_ms.item(i) + extra.item(i)
        else:
            i = int(base.argmin())
            latency = a.base_ms.item(i)
        return _decision(a.site[i], a.variant_id[i], reason, latency, t.cost[i], t.accuracy[i], True, 0,
                         t.estimated[i])

    def _best_effort_pool(self, t: TaskTable, q: Query) -> tuple[NDArray[np.float64], str]:
        """``base_ms`` masked to the best-effort pool of a ``prefer="latency"`` ``q`` (no exclusions)."""
        choose, reason = self._latency_choice(t, q, self._pool(t, q))
        return np.where(choose, t.arr.base_ms, _INF), reason

    def _pool(self, t: TaskTable, q: Query) -> NDArray[np.bool_]:
        """Hard-feasible candidates of ``q``, those with capacity if any; NoRoute if none."""
        a = t.arr
        hard = a.hard_ok & t.tenant_mask(q.tenant)
        for name in q.exclude_sites:
            pos = self._site_pos.get(name)
            if pos is not None:
                hard = hard & (a.site_idx != pos)
        if not any_true(hard):
            raise NoRoute(f"no live site can serve task {q.task!r} for tenant {q.tenant!r}", task=q.task)
        pool = hard & a.capacity_ok
        return pool if any_true(pool) else hard

    @staticmethod
    def _latency_choice(t: TaskTable, q: Query, pool: NDArray[np.bool_]) -> tuple[NDArray[np.bool_], str]:
        choose = pool & (t.arr.accuracy >= q.min_accuracy)
        return (choose if any_true(choose) else pool), "best_effort_latency"

    def _accuracy_choice(self, t: TaskTable, q: Query, pool: NDArray[np.bool_],
                         lat: NDArray[np.float64]) -> NDArray[np.bool_]:
        """The most accurate of ``pool`` reachable within the budget; else the most accurate loaded
        here; else all of ``pool`` (the caller takes the lowest latency of what is returned)."""
        a = t.arr
        within = pool & (lat <= min(q.budget_ms, 1e300))
        if not any_true(within):
            within = pool & a.loaded & (a.site_idx == self._site_pos[self.here])
            if not any_true(within):
                return pool
        return within & (a.accuracy >= a.accuracy[within].max())

    def _best_effort_full(self, t: TaskTable, q: Query) -> Decision:
        a = t.arr
        pool = self._pool(t, q)
        extra = t.request_ms(q.nbytes, q.rows)
        lat = a.base_ms + extra if extra is not None else a.base_ms.copy()
        if q.prefer == "refuse":
            raise self._refusal(t, q, pool, lat, extra)
        if q.prefer == "accuracy":
            choose, reason = self._accuracy_choice(t, q, pool, lat), "best_effort_accuracy"
        else:
            choose, reason = self._latency_choice(t, q, pool)
        i = int(np.where(choose, lat, _INF).argmin())
        return _decision(a.site[i], a.variant_id[i], reason, lat.item(i), t.cost[i], t.accuracy[i], True, 0,
                         t.estimated[i])

    def _refusal(self, t: TaskTable, q: Query, pool: NDArray[np.bool_], lat: NDArray[np.float64],
                 extra: NDArray[np.float64] | None) -> MeshError:
        """Why nothing fits ``q`` (``prefer="refuse"``), by the table in the module docstring: impossible as
        asked, late, or not now. ``pool``: the hard-feasible candidates; ``lat``: their latency now."""
        a = t.arr
        full = min(q.full_ms, 1e300)
        floor = a.floor_ms + extra if extra is not None else a.floor_ms
        visible = t.tenant_mask(q.tenant) & np.isfinite(floor)
        accurate = a.accuracy >= q.min_accuracy
        cost_now: NDArray[np.bool_] | bool = True
        possible = visible & accurate & (floor <= full)
        if q.max_cost is not None:
            # the warm cost of one row, plus what more rows bring (as cost_of() adds it to the cold cost)
            more = t.cost_of(q.rows) - a.cost if q.rows > 1 else 0.0
            possible &= a.floor_cost + more <= q.max_cost
            cost_now = t.cost_of(q.rows) <= q.max_cost
        if not any_true(possible):
            runs = visible if any_true(visible) else pool
            i_lat = int(np.where(runs, floor if any_true(visible) else lat, _INF).argmin())
            best_lat = float(floor[i_lat] if any_true(visible) else lat[i_lat])
            best_acc = float(a.accuracy[runs].max())
            return ImpossibleSLO(
                f"no site can serve {q.task!r} within {full:.1f} ms at accuracy >= {q.min_accuracy:.3f}"
                f"{'' if q.max_cost is None else f' at cost <= {q.max_cost:g}'}: best latency {best_lat:.1f} ms "
                f"(accuracy {a.accuracy[i_lat]:.3f}), best accuracy {best_acc:.3f}",
                task=q.task, best_latency_ms=best_lat, best_accuracy=best_acc)
        now = pool & a.capacity_ok & accurate & (lat <= full) & cost_now
        if any_true(now):
            i = int(np.where(now, lat, _INF).argmin())
            return DeadlineExceeded(
                f"{q.task!r}: {full - q.budget_ms:.1f} ms of the query's {full:.1f} ms budget was spent before this "
                f"decision (waiting at the door, or on a failed attempt; {max(q.budget_ms, 0.0):.1f} ms left); "
                f"{a.variant_id[i]} at {a.site[i]} would have met it in {lat[i]:.1f} ms",
                task=q.task, spent_ms=full - q.budget_ms, best_latency_ms=float(lat[i]))
        i = int(np.where(possible, floor, _INF).argmin())
        return Overloaded(
            f"no site can serve {q.task!r} within {full:.1f} ms at accuracy >= {q.min_accuracy:.3f} now: "
            f"{a.variant_id[i]} at {a.site[i]} could in {floor[i]:.1f} ms, but is busy, cold, down or left out",
            task=q.task, best_latency_ms=float(floor[i]))


_new = object.__new__
# Decision is frozen, so its generated __init__ sets each field through object.__setattr__ (over
# 2 µs here, a fifth of a decision); writing the slots through their descriptors is the same
# object, several times cheaper. Only for values decide() has already typed.
_SET_FIELDS = tuple(getattr(Decision, f.name).__set__ for f in fields(Decision))


def _decision(site: str, variant_id: str, reason: str, latency_ms: float, cost: float, accuracy: float,
              best_effort: bool, feasible_count: int, estimated: bool,
              _s: tuple[Callable[[Decision, object], None], ...] = _SET_FIELDS) -> Decision:
    d: Decision = _new(Decision)
    _s[0](d, site)
    _s[1](d, variant_id)
    _s[2](d, reason)
    _s[3](d, latency_ms)
    _s[4](d, cost)
    _s[5](d, accuracy)
    _s[6](d, best_effort)
    _s[7](d, feasible_count)
    _s[8](d, estimated)
    return d
