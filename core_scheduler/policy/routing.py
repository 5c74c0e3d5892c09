"""Per-query routing: which (site, variant) serves a query, by the DESIGN.md cost model.

A :class:`RoutingTable` is built once per (snapshot, here-site) when state changes; ``decide()``
then costs a handful of numpy operations over per-task candidate arrays.

Per candidate (site ``s``, variant ``v`` of the task), in milliseconds::

    latency = rtt(here, s)                 # round trip, snapshot.rtt_ms (2 x one-way path latency)
            + nbytes x 8 / bandwidth       # request bytes over the path's bottleneck; 0 when s == here
            + queue_ms(s, v)               # heartbeat's expected wait; 0 for a variant not loaded
            + compute(v, hw(s), b)         # profiled p50 of the batch it will likely join:
                                           # b = 1 + queue // compute(batch 1), capped at max_batch
            + load_ms(v, hw(s))            # only when v is not loaded at s: cold start is a cost

    cost    = (compute(1) + load_ms) / 1000 s x price_per_hour(s) / 3600 / slots(s)
              # dollars per query: the resource-seconds of one slot (one GPU, else one core) of
              # the machine; a cold start bills its load time, so loaded variants win ties.
              # Billed at batch 1: amortising by a batch estimated from a queue sample made busy
              # sites look cheaper and pulled traffic to them (positive feedback)

Filters. *Hard* (never served otherwise): site alive and reachable, variant profiled on the
site's hardware, enough free memory to load it if cold, tenant may use it (owner public or the
tenant), site not in ``exclude_sites``. *Soft* (the SLO, relaxed only by best effort):
latency <= budget, accuracy >= min_accuracy, site has capacity (inflight < capacity, not
degraded), cost <= max_cost.

Choice: least cost among feasible candidates, ties by lower latency, then the local site.
None feasible: ``prefer="latency"`` takes the lowest-latency candidate meeting the accuracy
floor (else the lowest latency overall); ``"accuracy"`` the most accurate (ties by latency);
both prefer sites with capacity and are flagged ``best_effort``; ``"refuse"`` raises
``ImpossibleSLO`` naming the best latency and accuracy on offer.

Reason codes (``Decision.reason``):

    local                 feasible, served at this site by a loaded variant
    forward               feasible, served at another site by a loaded variant
    cold_start            feasible, but the chosen variant must be loaded first (anywhere)
    best_effort_latency   nothing feasible; lowest latency chosen (prefer="latency")
    best_effort_accuracy  nothing feasible; highest accuracy chosen (prefer="accuracy")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import numpy as np
from numpy.typing import NDArray

from core_scheduler.policy.snapshot import MeshSnapshot, VariantInfo
from mesh.errors import ConfigError, ImpossibleSLO, NoRoute, UnknownTask
from mesh.types import DEFAULT_TENANT, SLO, Prefer

__all__ = ["COMPUTE_RESOLUTION_MS", "REASONS", "CandidateArrays", "Decision", "Query", "RoutingTable",
           "resolve_compute"]

REASONS = ("local", "forward", "cold_start", "best_effort_latency", "best_effort_accuracy")
_INF = np.inf
_MASK_CACHE_MAX = 256  # (tenant, min_accuracy) pairs kept per task; cleared when exceeded
_TRANSFER_CACHE_MAX = 64  # payload sizes whose transfer term is kept per task


@dataclass(frozen=True, slots=True)
class Query:
    task: str
    tenant: str = DEFAULT_TENANT
    budget_ms: float = float("inf")  # remaining, from this hop
    min_accuracy: float = 0.0
    max_cost: float | None = None
    prefer: Prefer = "latency"
    nbytes: int = 0
    exclude_sites: frozenset[str] = frozenset()

    @classmethod
    def from_slo(cls, task: str, tenant: str, slo: SLO, remaining_ms: float, nbytes: int = 0,
                 exclude_sites: frozenset[str] = frozenset()) -> Query:
        return cls(task=task, tenant=tenant, budget_ms=remaining_ms, min_accuracy=slo.min_accuracy,
                   max_cost=slo.max_cost, prefer=slo.prefer, nbytes=nbytes, exclude_sites=exclude_sites)


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


@dataclass(frozen=True, slots=True)
class CandidateArrays:
    """Every (site, variant) pair of one task, sorted by (cost, static latency, not-here).

    ``base_ms`` is the latency without the transfer term; ``hard_ok`` the hard filters except
    tenant access and exclusion; ``capacity_ok`` the site's capacity."""

    site: tuple[str, ...]
    variant_id: tuple[str, ...]
    owner: tuple[str, ...]
    site_idx: NDArray[np.int64]
    rtt_ms: NDArray[np.float64]
    per_byte_ms: NDArray[np.float64]
    queue_ms: NDArray[np.float64]
    compute_ms: NDArray[np.float64]
    load_ms: NDArray[np.float64]
    base_ms: NDArray[np.float64]
    cost: NDArray[np.float64]
    accuracy: NDArray[np.float64]
    loaded: NDArray[np.bool_]
    hard_ok: NDArray[np.bool_]
    capacity_ok: NDArray[np.bool_]

    def latency_ms(self, nbytes: int) -> NDArray[np.float64]:
        return self.base_ms + self.per_byte_ms * float(nbytes) if nbytes else self.base_ms.copy()

    def __len__(self) -> int:
        return len(self.site)


class _TaskTable:
    """Candidate arrays of one task plus lazily cached per-tenant masks.

    ``decide()`` runs per query, so the per-candidate scalars it returns are kept as Python
    lists too: indexing a list is several times cheaper than a numpy scalar plus ``float()``."""

    __slots__ = ("access", "accuracy", "arr", "best", "cost", "masked", "n", "public", "reason",
                 "tie_end", "tie_end_l", "transfer", "visible")

    def __init__(self, arr: CandidateArrays, here: str = "") -> None:
        self.arr = arr
        self.n = len(arr)
        self.public = np.array([o == "public" for o in arr.owner], dtype=bool)
        self.access: dict[str, NDArray[np.bool_]] = {}
        self.visible: dict[str, bool] = {}
        self.masked: dict[tuple[str, float], NDArray[np.float64]] = {}
        self.best: dict[tuple[str, float, str], tuple[NDArray[np.float64], str]] = {}
        self.transfer: dict[int, NDArray[np.float64]] = {}
        self.cost: list[float] = arr.cost.tolist()
        self.accuracy: list[float] = arr.accuracy.tolist()
        self.reason: tuple[str, ...] = tuple(
            ("local" if s == here else "forward") if loaded else "cold_start"
            for s, loaded in zip(arr.site, arr.loaded.tolist(), strict=True))
        # equal-cost runs are contiguous (sorted by cost); tie_end[i] = one past i's run
        cost = arr.cost
        if self.n:
            same = np.isclose(cost[1:], cost[:-1], rtol=1e-9, atol=0.0) & np.isfinite(cost[1:])
            starts = np.flatnonzero(np.concatenate(([True], ~same)))
            ends = np.append(starts[1:], self.n)
            self.tie_end = np.repeat(ends, np.diff(np.append(starts, self.n)))
        else:
            self.tie_end = np.zeros(0, dtype=np.int64)
        self.tie_end_l: list[int] = self.tie_end.tolist()

    def tenant_mask(self, tenant: str) -> NDArray[np.bool_]:
        mask = self.access.get(tenant)
        if mask is None:
            mask = self.public | np.array([o == tenant for o in self.arr.owner], dtype=bool)
            if len(self.access) >= _MASK_CACHE_MAX:
                self.access.clear()
                self.visible.clear()
            self.access[tenant] = mask
            self.visible[tenant] = _any(mask)
        return mask

    def transfer_ms(self, nbytes: int) -> NDArray[np.float64]:
        """Per-candidate transfer term of an ``nbytes`` request (read-only, cached per size).

        A task's payload size rarely varies (fixed input tensors), so caching it per size saves
        a ufunc call (~1 µs, most of it call overhead at these sizes) on the hot path."""
        out = self.transfer.get(nbytes)
        if out is None:
            out = self.arr.per_byte_ms * float(nbytes)
            out.flags.writeable = False
            if len(self.transfer) >= _TRANSFER_CACHE_MAX:
                self.transfer.clear()
            self.transfer[nbytes] = out
        return out

    def masked_base(self, tenant: str, min_accuracy: float) -> NDArray[np.float64]:
        """``base_ms`` where every filter but budget, cost and exclusion passes, else inf."""
        key = (tenant, min_accuracy)
        out = self.masked.get(key)
        if out is None:
            a = self.arr
            ok = a.hard_ok & a.capacity_ok & self.tenant_mask(tenant) & (a.accuracy >= min_accuracy)
            out = np.where(ok, a.base_ms, _INF)
            if len(self.masked) >= _MASK_CACHE_MAX:
                self.masked.clear()
            self.masked[key] = out
        return out


class RoutingTable:
    """Routing decisions at site ``here`` over one snapshot. Cheap to query, rebuilt on change."""

    __slots__ = ("_site_pos", "_tasks", "here", "version")

    def __init__(self, here: str, version: int, tasks: Mapping[str, _TaskTable],
                 site_pos: Mapping[str, int]) -> None:
        self.here = here
        self.version = version
        self._tasks = dict(tasks)
        self._site_pos = dict(site_pos)

    @classmethod
    def build(cls, snap: MeshSnapshot, here: str) -> RoutingTable:
        if here not in snap.site_index:
            raise ConfigError(f"routing site {here!r} is not in the topology")
        tasks = {task: _TaskTable(_candidates(snap, here, vs), here)
                 for task, vs in snap.variants.items() if vs}
        return cls(here, snap.version, tasks, snap.site_index)

    def tasks(self) -> tuple[str, ...]:
        return tuple(sorted(self._tasks))

    def candidates(self, task: str) -> CandidateArrays:
        return self._table(task).arr

    def _table(self, task: str) -> _TaskTable:
        t = self._tasks.get(task)
        if t is None:
            raise UnknownTask(f"no variant of task {task!r} is registered", task=task)
        return t

    def decide(self, q: Query) -> Decision:
        t = self._tasks.get(q.task)
        if t is None:
            raise UnknownTask(f"no variant of task {q.task!r} is registered", task=q.task)
        # a cached masked base implies the tenant was visible when it was made, and visibility
        # is fixed per table: the hit skips the visibility lookups
        base = t.masked.get((q.tenant, q.min_accuracy))
        if base is None:
            visible = t.visible.get(q.tenant)
            if visible is None:
                t.tenant_mask(q.tenant)
                visible = t.visible[q.tenant]
            if not visible:
                raise UnknownTask(f"no variant of task {q.task!r} is visible to tenant {q.tenant!r}",
                                  task=q.task)
            base = t.masked_base(q.tenant, q.min_accuracy)
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
                         t.accuracy[i], False, int(np.count_nonzero(ok)))

    def _decide_restricted(self, t: _TaskTable, q: Query, base: NDArray[np.float64]) -> Decision:
        """``decide()`` under a cost ceiling or site exclusions."""
        a = t.arr
        # sorted by cost, so a cost ceiling is a prefix
        n = t.n if q.max_cost is None else int(np.searchsorted(a.cost, q.max_cost, side="right"))
        if n:
            per_byte = a.per_byte_ms if n == t.n else a.per_byte_ms[:n]
            if n != t.n:
                base = base[:n]
            if q.nbytes:
                lat = per_byte * float(q.nbytes)
                lat += base
            else:
                lat = base
            # an infinite budget must not admit masked (inf) candidates
            ok = lat <= min(q.budget_ms, 1e300)
            for name in q.exclude_sites:
                pos = self._site_pos.get(name)
                if pos is not None:
                    ok &= (a.site_idx if n == t.n else a.site_idx[:n]) != pos
            i = int(ok.argmax())
            if ok[i]:
                end = min(t.tie_end_l[i], n)
                # an equal-cost run is sorted by static latency; only the transfer term can
                # reorder it. Without exclusions every entry below lat[i] is feasible too.
                if end - i > 1 and q.nbytes:
                    if q.exclude_sites:
                        i += int(np.where(ok[i:end], lat[i:end], _INF).argmin())
                    else:
                        i += int(lat[i:end].argmin())
                return _decision(a.site[i], a.variant_id[i], t.reason[i], lat.item(i), t.cost[i],
                                 t.accuracy[i], False, int(np.count_nonzero(ok)))
        return self._best_effort(t, q)

    def _best_effort(self, t: _TaskTable, q: Query) -> Decision:
        if q.exclude_sites or q.prefer == "refuse":
            return self._best_effort_full(t, q)
        # without exclusions the chosen pool depends on (tenant, accuracy floor, prefer) only:
        # cache it as a masked base so a query costs one transfer term and an argmin
        key = (q.tenant, q.min_accuracy, q.prefer)
        hit = t.best.get(key)
        if hit is None:
            hit = self._best_effort_pool(t, q)
            if len(t.best) >= _MASK_CACHE_MAX:
                t.best.clear()
            t.best[key] = hit
        base, reason = hit
        a = t.arr
        if q.nbytes:
            lat = t.transfer_ms(q.nbytes) + base  # inf + a finite transfer stays inf: masked stay out
            i = int(lat.argmin())
            # from the unmasked terms, as a.latency_ms() has it (should every pick be inf)
            latency = a.base_ms.item(i) + a.per_byte_ms.item(i) * float(q.nbytes)
        else:
            i = int(base.argmin())
            latency = a.base_ms.item(i)
        return _decision(a.site[i], a.variant_id[i], reason, latency, t.cost[i], t.accuracy[i], True, 0)

    def _best_effort_pool(self, t: _TaskTable, q: Query) -> tuple[NDArray[np.float64], str]:
        """``base_ms`` masked to the best-effort pool of ``q`` (no exclusions, not refuse)."""
        choose, reason = self._best_effort_choice(t, q, self._pool(t, q))
        return np.where(choose, t.arr.base_ms, _INF), reason

    def _pool(self, t: _TaskTable, q: Query) -> NDArray[np.bool_]:
        """Hard-feasible candidates of ``q``, those with capacity if any; NoRoute if none."""
        a = t.arr
        hard = a.hard_ok & t.tenant_mask(q.tenant)
        for name in q.exclude_sites:
            pos = self._site_pos.get(name)
            if pos is not None:
                hard = hard & (a.site_idx != pos)
        if not _any(hard):
            raise NoRoute(f"no live site can serve task {q.task!r} for tenant {q.tenant!r}", task=q.task)
        pool = hard & a.capacity_ok
        return pool if _any(pool) else hard

    @staticmethod
    def _best_effort_choice(t: _TaskTable, q: Query, pool: NDArray[np.bool_]) -> tuple[NDArray[np.bool_], str]:
        a = t.arr
        if q.prefer == "accuracy":
            best_acc = a.accuracy[pool].max()
            return pool & (a.accuracy >= best_acc), "best_effort_accuracy"
        choose = pool & (a.accuracy >= q.min_accuracy)
        return (choose if _any(choose) else pool), "best_effort_latency"

    def _best_effort_full(self, t: _TaskTable, q: Query) -> Decision:
        a = t.arr
        pool = self._pool(t, q)
        lat = a.latency_ms(q.nbytes)
        if q.prefer == "refuse":
            i_lat = int(np.where(pool, lat, _INF).argmin())
            best_acc = float(a.accuracy[pool].max())
            raise ImpossibleSLO(
                f"no site can serve {q.task!r} within {q.budget_ms:.1f} ms at accuracy >= "
                f"{q.min_accuracy:.3f}: best latency {lat[i_lat]:.1f} ms (accuracy "
                f"{a.accuracy[i_lat]:.3f}), best accuracy {best_acc:.3f}",
                task=q.task, best_latency_ms=float(lat[i_lat]), best_accuracy=best_acc)
        choose, reason = self._best_effort_choice(t, q, pool)
        i = int(np.where(choose, lat, _INF).argmin())
        return _decision(a.site[i], a.variant_id[i], reason, lat.item(i), t.cost[i], t.accuracy[i], True, 0)


_new = object.__new__
# Decision is frozen, so its generated __init__ sets each field through object.__setattr__ (over
# 2 µs here, a fifth of a decision); writing the slots through their descriptors is the same
# object, several times cheaper. Only for values decide() has already typed.
_SET_FIELDS = tuple(getattr(Decision, f.name).__set__ for f in fields(Decision))


def _decision(site: str, variant_id: str, reason: str, latency_ms: float, cost: float, accuracy: float,
              best_effort: bool, feasible_count: int,
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
    return d


# Profiles cannot tell apart compute times closer than this: below it the serving path's own
# overhead (an executor hop is ~0.2 ms here) and run-to-run noise dominate. Compute is rounded up
# to this resolution, so variants that differ by less tie and the tie goes to the smaller one.
COMPUTE_RESOLUTION_MS = 0.05


def resolve_compute(ms: float) -> float:
    """``ms`` rounded up to ``COMPUTE_RESOLUTION_MS`` (what profiles can tell apart)."""
    if not np.isfinite(ms) or ms <= 0:
        return ms
    return float(np.ceil(ms / COMPUTE_RESOLUTION_MS - 1e-9) * COMPUTE_RESOLUTION_MS)


def _any(mask: NDArray[np.bool_]) -> bool:
    # count_nonzero beats ndarray.any() several-fold on small boolean arrays (no ufunc reduce)
    return bool(np.count_nonzero(mask))


def _candidates(snap: MeshSnapshot, here: str, variants: tuple[VariantInfo, ...]) -> CandidateArrays:
    """Static per-candidate terms; Python loops are fine here (once per state change)."""
    h = snap.site_index[here]
    names = sorted(snap.site_index, key=lambda s: (s != here, s))
    rows: list[tuple[object, ...]] = []
    for s in names:
        info = snap.sites[s]
        j = snap.site_index[s]
        load = snap.loads.get(s)
        rtt = float(snap.rtt_ms[h, j])
        bw = float(snap.bandwidth_mbps[h, j])
        reachable = np.isfinite(rtt) and bw > 0
        per_byte = 0.0 if (s == here or not reachable) else 8.0 / (bw * 1000.0)
        alive = info.alive and load is not None
        cap_ok = load is not None and load.has_capacity
        hw = info.hardware_class
        for v in variants:
            loaded = load is not None and v.variant_id in load.loaded
            queue = float(load.queue_ms.get(v.variant_id, 0.0)) if (load is not None and loaded) else 0.0
            c1 = v.compute_at(hw, 1)
            batch = 1
            if queue > 0 and np.isfinite(c1) and c1 > 0:
                batch = max(1, min(v.max_batch, 1 + int(queue // c1)))
            compute = resolve_compute(v.compute_at(hw, batch))
            runs = v.runs_on(hw)
            load_ms = 0.0 if loaded else v.load_at(hw)
            fits = loaded or (load is not None and v.memory_bytes <= load.memory_free_bytes)
            hard = bool(alive and reachable and runs and fits)
            if runs:
                # billed at batch 1: the batch a query will join is estimated from a heartbeat's queue
                # sample, and amortising by it made a busy site look cheaper and drew more traffic to
                # it (a feedback loop that sent far edges' queries past the cheaper core)
                cost = (resolve_compute(c1) + load_ms) / 1000.0 * info.price_per_hour / 3600.0 / info.slots
            else:
                cost = float("inf")
            base = rtt + queue + compute + load_ms if reachable else float("inf")
            rows.append((s, v.variant_id, v.owner, j, rtt, per_byte, queue, compute, load_ms, base,
                         cost, v.accuracy, loaded, hard, cap_ok, s != here, v.size_bytes))
    cols = list(zip(*rows, strict=True)) if rows else [()] * 17
    cost_a = np.array(cols[10], dtype=np.float64)
    base_a = np.array(cols[9], dtype=np.float64)
    not_here = np.array(cols[15], dtype=bool)
    size_a = np.array(cols[16], dtype=np.float64)
    # lexsort: last key is primary: cost, then latency, then here before elsewhere, then the smaller
    # variant (memory is what an edge lacks); it is stable, so equal keys keep (site, variant) order
    order = np.lexsort((size_a, not_here, base_a, cost_a)) if rows else np.zeros(0, dtype=np.int64)

    def f(k: int) -> NDArray[np.float64]:
        return np.asarray(np.array(cols[k], dtype=np.float64)[order])

    def b(k: int) -> NDArray[np.bool_]:
        return np.asarray(np.array(cols[k], dtype=bool)[order])

    def s_(k: int) -> tuple[str, ...]:
        return tuple(str(cols[k][i]) for i in order)

    return CandidateArrays(site=s_(0), variant_id=s_(1), owner=s_(2),
                           site_idx=np.array(cols[3], dtype=np.int64)[order], rtt_ms=f(4),
                           per_byte_ms=f(5), queue_ms=f(6), compute_ms=f(7), load_ms=f(8),
                           base_ms=f(9), cost=f(10), accuracy=f(11), loaded=b(12), hard_ok=b(13),
                           capacity_ok=b(14))
