"""The candidate table of :mod:`core_scheduler.policy.routing`: every (site, variant) pair of a task
with its static cost-model terms, built once per (snapshot, here-site) when state changes, plus the
per-tenant masks ``decide()`` caches on it.

Per candidate (site ``s``, variant ``v`` of the task), in milliseconds::

    latency = rtt(here, s)                 # round trip, snapshot.rtt_ms (2 x one-way path latency)
            + margin(here, s)              # tail allowance of the path, snapshot.margin_ms: declared
                                           # jitter + a share of the round trip; 0 when s == here
            + nbytes x 8 / bandwidth       # request bytes over the path's bottleneck; 0 when s == here
            + queue_ms(s, v)               # heartbeat's expected wait; 0 for a variant not loaded
            + compute(v, hw(s), b)         # profiled p50 of the batch it will likely join:
                                           # b = 1 + queue // compute(batch 1), capped at max_batch
            + rows term                    # a request of r rows makes that batch b + r - 1 rows:
                                           # compute(v, hw(s), b + r - 1) - compute(v, hw(s), b),
                                           # per request (TaskTable.rows_ms); 0 for one row. Flat on
                                           # a GPU, steep on a CPU: what sends big batches to GPUs
            + load_ms(v, hw(s))            # only when v is not loaded at s: cold start is a cost,
            + fetch(s, v)                  # and so is fetching its blob first, from the nearest of
                                           # the variant store's site and the live sites holding v
                                           # (round trip + size / bandwidth)

    cost    = (compute(1) + load_ms) / 1000 s x price_per_hour(s) / 3600 / slots(s)
              # dollars per query: the resource-seconds of one slot (one GPU, else one core) of
              # the machine; a cold start bills its load time, so loaded variants win ties.
              # Billed at batch 1: amortising by a batch estimated from a queue sample made busy
              # sites look cheaper and pulled traffic to them (positive feedback). A request of r
              # rows is billed the work it brings itself, compute(r) instead of compute(1)
              # (TaskTable.rows_cost): no estimate, so no feedback, and a GPU that computes 64 rows
              # in the time of one can be the cheaper place for them though not for one row

Filters folded in here: ``hard_ok`` (site alive and reachable, variant profiled on the site's
hardware, enough free memory to load it if cold) and ``capacity_ok``. Tenant access and the accuracy
floor are masks cached on the :class:`TaskTable` per (tenant, floor); exclusions, budget and cost
ceiling are applied per query by ``decide()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from core_scheduler.policy.snapshot import MeshSnapshot, VariantInfo
from mesh.cache import BoundedCache

__all__ = ["COMPUTE_RESOLUTION_MS", "MASK_CACHE_MAX", "CandidateArrays", "TaskTable", "TaskTables", "any_true",
           "build_candidates", "resolve_compute"]

_INF = np.inf
MASK_CACHE_MAX = 256  # tenants, or (tenant, min_accuracy) pairs, kept per task
_TRANSFER_CACHE_MAX = 64  # payload sizes whose transfer term is kept per task


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
    load_ms: NDArray[np.float64]  # cold-start latency: load + blob fetch; 0 when loaded
    base_ms: NDArray[np.float64]
    cost: NDArray[np.float64]
    accuracy: NDArray[np.float64]
    loaded: NDArray[np.bool_]
    hard_ok: NDArray[np.bool_]
    capacity_ok: NDArray[np.bool_]
    # what the rows term needs: each candidate's variant, its site's hardware class, its likely batch
    variant: tuple[VariantInfo, ...] = ()
    hardware_class: tuple[str, ...] = ()
    batch: tuple[int, ...] = ()
    price_per_ms: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))  # dollars per slot-ms
    # what the candidate could do at best, whatever the mesh's state (round trip + margin + compute at batch 1,
    # warm, no queue; inf where the variant cannot run on the site's class or the site is unreachable) and its
    # cost then: what ``decide()`` judges an SLO impossible by (``routing``: 422 means impossible, not late)
    floor_ms: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    floor_cost: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    # the variant's timings on the site's class are an estimate (snapshot.with_estimates), not a measurement
    estimated: NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def latency_ms(self, nbytes: int) -> NDArray[np.float64]:
        return self.base_ms + self.per_byte_ms * float(nbytes) if nbytes else self.base_ms.copy()

    def rows_ms(self, rows: int) -> NDArray[np.float64]:
        """Per candidate, what ``rows`` rows add to the compute term of one row (0 where unprofiled)."""
        out = np.zeros(len(self.site), dtype=np.float64)
        if rows > 1:
            for i, (v, hw, b) in enumerate(zip(self.variant, self.hardware_class, self.batch, strict=True)):
                now, then = float(self.compute_ms[i]), resolve_compute(v.compute_at(hw, b + rows - 1))
                if math.isfinite(now) and math.isfinite(then):  # unprofiled there: no term (it is masked anyway)
                    out[i] = max(0.0, then - now)
        return out

    def rows_cost(self, rows: int) -> NDArray[np.float64]:
        """Per candidate, the cost of a request of ``rows`` rows: compute(rows) billed instead of compute(1)."""
        extra = np.zeros(len(self.site), dtype=np.float64)
        for i, (v, hw) in enumerate(zip(self.variant, self.hardware_class, strict=True)):
            one, many = resolve_compute(v.compute_at(hw, 1)), resolve_compute(v.compute_at(hw, rows))
            if math.isfinite(one) and math.isfinite(many):
                extra[i] = max(0.0, many - one) * self.price_per_ms[i]
        return self.cost + extra

    def __len__(self) -> int:
        return len(self.site)


class TaskTable:
    """Candidate arrays of one task plus lazily cached per-tenant masks.

    ``decide()`` runs per query, so the per-candidate scalars it returns are kept as Python
    lists too: indexing a list is several times cheaper than a numpy scalar plus ``float()``.
    The caches live as long as the table (one snapshot) and are keyed by what queries repeat: a
    tenant, its accuracy floor, a payload size. A hit replaces a few whole-array numpy operations
    (microseconds at thousands of candidates) with one lookup."""

    __slots__ = ("access", "accuracy", "arr", "best", "cost", "estimated", "masked", "n", "public", "reason", "rows",
                 "rows_costs", "tie_end", "tie_end_l", "transfer")

    def __init__(self, arr: CandidateArrays, here: str = "") -> None:
        self.arr = arr
        self.n = len(arr)
        self.public = np.array([o == "public" for o in arr.owner], dtype=bool)
        # tenant -> (the candidates it may use, whether there is any)
        self.access: BoundedCache[str, tuple[NDArray[np.bool_], bool]] = BoundedCache(MASK_CACHE_MAX)
        # (tenant, min_accuracy) -> base_ms with every other filter applied (inf where one fails)
        self.masked: BoundedCache[tuple[str, float], NDArray[np.float64]] = BoundedCache(MASK_CACHE_MAX)
        # (tenant, min_accuracy, prefer) -> best-effort pool as a masked base, and its reason
        self.best: BoundedCache[tuple[str, float, str], tuple[NDArray[np.float64], str]] = \
            BoundedCache(MASK_CACHE_MAX)
        # payload bytes -> per-candidate transfer term
        self.transfer: BoundedCache[int, NDArray[np.float64]] = BoundedCache(_TRANSFER_CACHE_MAX)
        # rows per request -> per-candidate rows term
        self.rows: BoundedCache[int, NDArray[np.float64]] = BoundedCache(_TRANSFER_CACHE_MAX)
        # rows per request -> per-candidate cost of such a request
        self.rows_costs: BoundedCache[int, NDArray[np.float64]] = BoundedCache(_TRANSFER_CACHE_MAX)
        self.cost: list[float] = arr.cost.tolist()
        self.accuracy: list[float] = arr.accuracy.tolist()
        self.estimated: list[bool] = arr.estimated.tolist()
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

    def tenant_access(self, tenant: str) -> tuple[NDArray[np.bool_], bool]:
        """The candidates ``tenant`` may use (public or its own), and whether there is any."""
        found = self.access.get(tenant)
        if found is None:
            mask = self.public | np.array([o == tenant for o in self.arr.owner], dtype=bool)
            found = self.access.put(tenant, (mask, any_true(mask)))
        return found

    def tenant_mask(self, tenant: str) -> NDArray[np.bool_]:
        return self.tenant_access(tenant)[0]

    def transfer_ms(self, nbytes: int) -> NDArray[np.float64]:
        """Per-candidate transfer term of an ``nbytes`` request (read-only, cached per size).

        A task's payload size rarely varies (fixed input tensors), so caching it per size saves
        a ufunc call (~1 µs, most of it call overhead at these sizes) on the hot path."""
        out = self.transfer.get(nbytes)
        if out is None:
            out = self.arr.per_byte_ms * float(nbytes)
            out.flags.writeable = False
            self.transfer.put(nbytes, out)
        return out

    def request_ms(self, nbytes: int, rows: int) -> NDArray[np.float64] | None:
        """The per-request terms (transfer of ``nbytes``, ``rows`` rows' compute), None when both are 0."""
        if rows > 1:
            extra = self.rows.get(rows)
            if extra is None:
                extra = self.arr.rows_ms(rows)
                extra.flags.writeable = False
                self.rows.put(rows, extra)
            return self.transfer_ms(nbytes) + extra if nbytes else extra
        return self.transfer_ms(nbytes) if nbytes else None

    def cost_of(self, rows: int) -> NDArray[np.float64]:
        """Per-candidate cost of a request of ``rows`` rows (read-only, cached per row count)."""
        out = self.rows_costs.get(rows)
        if out is None:
            out = self.arr.rows_cost(rows)
            out.flags.writeable = False
            self.rows_costs.put(rows, out)
        return out

    def masked_base(self, tenant: str, min_accuracy: float) -> NDArray[np.float64]:
        """``base_ms`` where every filter but budget, cost and exclusion passes, else inf."""
        key = (tenant, min_accuracy)
        out = self.masked.get(key)
        if out is None:
            a = self.arr
            ok = a.hard_ok & a.capacity_ok & self.tenant_mask(tenant) & (a.accuracy >= min_accuracy)
            out = self.masked.put(key, np.where(ok, a.base_ms, _INF))
        return out


# Profiles cannot tell apart compute times closer than this: below it the serving path's own
# overhead (an executor hop is ~0.2 ms here) and run-to-run noise dominate. Compute is rounded up
# to this resolution, so variants that differ by less tie and the tie goes to the smaller one.
COMPUTE_RESOLUTION_MS = 0.05


def resolve_compute(ms: float) -> float:
    """``ms`` rounded up to ``COMPUTE_RESOLUTION_MS`` (what profiles can tell apart)."""
    if not np.isfinite(ms) or ms <= 0:
        return ms
    return float(np.ceil(ms / COMPUTE_RESOLUTION_MS - 1e-9) * COMPUTE_RESOLUTION_MS)


def any_true(mask: NDArray[np.bool_]) -> bool:
    # count_nonzero beats ndarray.any() several-fold on small boolean arrays (no ufunc reduce)
    return bool(np.count_nonzero(mask))


def build_candidates(snap: MeshSnapshot, here: str, variants: tuple[VariantInfo, ...]) -> CandidateArrays:
    """Static per-candidate terms; Python loops are fine here (once per state change)."""
    h = snap.site_index[here]
    names = sorted(snap.site_index, key=lambda s: (s != here, s))
    rows: list[tuple[object, ...]] = []
    holders = {v.variant_id: snap.holders(v.variant_id) for v in variants} if snap.store_site else {}
    for s in names:
        info = snap.sites[s]
        j = snap.site_index[s]
        load = snap.loads.get(s)
        rtt = float(snap.rtt_ms[h, j])
        margin = float(snap.margin_ms[h, j]) if snap.margin_ms is not None else 0.0
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
            fetch = 0.0 if loaded or not snap.store_site else snap.fetch_ms(s, v.size_bytes, holders[v.variant_id])
            fits = loaded or (load is not None and v.memory_bytes <= load.memory_free_bytes)
            hard = bool(alive and reachable and runs and fits)
            if runs:
                # billed at batch 1: the batch a query will join is estimated from a heartbeat's queue
                # sample, and amortising by it made a busy site look cheaper and drew more traffic to
                # it (a feedback loop that sent far edges' queries past the cheaper core)
                cost = (resolve_compute(c1) + load_ms) / 1000.0 * info.price_per_hour / 3600.0 / info.slots
            else:
                cost = float("inf")
            base = rtt + margin + queue + compute + load_ms + fetch if reachable else float("inf")
            price_ms = info.price_per_hour / 3600.0 / info.slots / 1000.0
            warm = resolve_compute(c1)
            floor = rtt + margin + warm if reachable and runs else float("inf")
            floor_cost = warm * price_ms if runs else float("inf")
            rows.append((s, v.variant_id, v.owner, j, rtt, per_byte, queue, compute, load_ms + fetch, base,
                         cost, v.accuracy, loaded, hard, cap_ok, s != here, v.size_bytes, v, hw, batch, price_ms,
                         floor, floor_cost, hw in v.estimated))
    cols = list(zip(*rows, strict=True)) if rows else [()] * 24
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
                           capacity_ok=b(14), variant=tuple(cols[17][i] for i in order),
                           hardware_class=s_(18), batch=tuple(int(cols[19][i]) for i in order),
                           price_per_ms=f(20), floor_ms=f(21), floor_cost=f(22),
                           estimated=b(23))


class TaskTables(Mapping[str, TaskTable]):
    """Every task's :class:`TaskTable` over one snapshot, each built the first time it is asked for. A site rebuilds
    its routing table on every change of the view, heartbeats included, and routes only the tasks its callers ask
    for: a 0.1-core edge spent 45 % of its time building tables (issue 30), mostly for tasks it never routed (the
    catalog's other families, their pipeline stages). Which tasks there are is known without building any."""

    __slots__ = ("_built", "_here", "_snap")

    def __init__(self, snap: MeshSnapshot, here: str) -> None:
        self._snap, self._here = snap, here
        self._built: dict[str, TaskTable] = {}

    def __getitem__(self, task: str) -> TaskTable:
        t = self._built.get(task)
        if t is None:
            variants = self._snap.variants.get(task)
            if not variants:
                raise KeyError(task)
            t = self._built[task] = TaskTable(build_candidates(self._snap, self._here, variants), self._here)
        return t

    def __contains__(self, task: object) -> bool:
        return isinstance(task, str) and bool(self._snap.variants.get(task))

    def __iter__(self) -> Iterator[str]:
        return (task for task, vs in self._snap.variants.items() if vs)

    def __len__(self) -> int:
        return sum(1 for vs in self._snap.variants.values() if vs)
