"""Offline jobs' policies, pure: which variant runs a job, whether its deadline and cost ceiling can be met, which
sites the scheduler leader hands its chunks to, and which chunk a site should claim now.

Units and conventions: compute from the catalog's measured profiles (``Profile.compute_ms`` at the largest batch
profiled, per row); prices are the topology's USD per hour for a site's whole hardware, spread evenly over its
cores (a chunk worker runs one batch at a time, on about one core); times in seconds.

One projection serves admission and assignment, so the two agree: a set of sites finishes ``rows`` in ``chunks``
in ``SAFETY x (rows / summed throughput + chunks x CHUNK_OVERHEAD_S / sites + load time)``, each site's throughput
``HARVEST x 1000 / row_ms`` rows per second on its hardware class. ``HARVEST`` is the share of an idle site's core a
chunk worker is counted on for (it yields to every online query between batches); ``SAFETY`` covers the online
load changing under it. Neither is measured yet: both err towards using more sites sooner.

- ``estimate`` (admission): the deadline the idle sites together can meet, and the cost of the cheapest plan at
  all (every row on the site cheapest per row), a lower bound any ``max_cost`` must clear; ``cheapest_plan``: the
  cheapest set of sites meeting a given deadline and what it costs.
- ``assign`` (the leader, each round): jobs by earliest deadline; for each, sites cheapest per row first (price per
  core x the variant's compute per row on that site's class), adding the next dearer one while the projected
  finish of the rows left exceeds the time left; each chosen site is handed a few chunks ahead (enough to last
  until the next round reaches it, ``MIN_AHEAD``..``MAX_AHEAD``, counting the chunks it runs), never the whole job.
  An assignment to a site that left, or held unclaimed ``HOLD_S`` by a site running nothing, is taken back.
- ``claim_choice`` (each site's worker): what was assigned to it first; while the leader leads the job (an
  assignment renewed within ``ASSIGN_GRACE_S``) nothing else; otherwise the local rule ``may_claim`` (idle and among
  the cheapest idle sites, any idle site after ``CLAIM_GRACE_S``), so a dead or slow leader never stops a job.
  Freshness compares the leader's wall clock with the site's, as the claim grace compares the door's: clocks
  seconds apart move the fallback by that much and lose nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from topology.schema import Site
from variant_store.meta import PUBLIC, VariantMeta

__all__ = ["ASSIGN_GRACE_S", "HARVEST", "SAFETY", "AssignPlan", "Assigned", "Beat", "Capacity", "Estimate", "JobWork",
           "assign", "capacities", "cheapest_plan", "cheapest_variant", "claim_choice", "estimate", "job_candidates",
           "job_variant", "may_claim", "row_ms"]

SAFETY = 2.0              # the estimate's margin: harvested capacity comes and goes with the online load
CHUNK_OVERHEAD_S = 0.25   # per chunk: claim + commit in etcd, input read, output upload (measured ~0.1 s here)
CLAIM_GRACE_S = 10.0      # a chunk left queued this long may be claimed by any idle site, cheapest or not
PRICE_SLACK = 1.05        # sites within 5 % of the cheapest count as cheapest
HARVEST = 0.75            # the share of an idle site's core a chunk worker is counted on for (assumed, not measured)
ASSIGN_GRACE_S = CLAIM_GRACE_S  # an assignment not renewed this long is stale: the leader is dead or slow
RENEW_S = ASSIGN_GRACE_S / 3    # how often the leader renews an assignment that still stands
HOLD_S = CLAIM_GRACE_S    # an assignment held unclaimed this long by a site running no chunk is taken back
MIN_AHEAD, MAX_AHEAD = 2, 8  # chunks a chosen site holds (running + assigned): enough to last until the next round
HORIZON_S = 3.0           # ... which is about the leader's round plus the worker's poll away


@dataclass(frozen=True, slots=True)
class Capacity:
    """A live site that could run chunk work: its price per core-hour and hardware class; ``idle``: its online
    load is below the threshold now."""

    site: str
    hardware_class: str | None
    price_per_core_hour: float
    idle: bool = True


@dataclass(frozen=True, slots=True)
class Estimate:
    """How long (``seconds``, with ``SAFETY``) a job takes on ``sites`` together, and how much (``cost``, USD) its
    plan costs; ``site``: the cheapest per row of them."""

    variant: str
    site: str
    seconds: float
    cost: float
    sites: tuple[str, ...] = ()


def row_ms(meta: VariantMeta, hardware_class: str | None = None) -> float | None:
    """Per-row compute in ms at the largest profiled batch: on ``hardware_class`` when profiled there, else the
    slowest profiled class (conservative); None without any profile."""
    profiles = meta.profiles
    if hardware_class is not None and hardware_class in profiles:
        chosen = [profiles[hardware_class]]
    else:
        chosen = list(profiles.values())
    costs = []
    for p in chosen:
        if not p.latency:
            continue
        batch = max(p.latency)
        costs.append(p.compute_ms(batch) / batch)
    return max(costs) if costs else None


def cheapest_variant(metas: Iterable[VariantMeta], min_accuracy: float,
                     hardware_class: str | None = None) -> VariantMeta | None:
    """The variant meeting ``min_accuracy`` with the least compute per row at large batch (profiled ones first;
    ties -> higher accuracy, then id, so every site picks the same one)."""
    ok = [m for m in metas if m.accuracy >= min_accuracy]

    def key(m: VariantMeta) -> tuple[float, float, str]:
        ms = row_ms(m, hardware_class)
        return (math.inf if ms is None else ms, -m.accuracy, m.variant_id)

    return min(ok, key=key) if ok else None


def _ranked(meta: VariantMeta, sites: Iterable[Capacity]) -> list[tuple[Capacity, float]]:
    """``sites`` that have a compute estimate for ``meta``, with it (ms per row), cheapest per row first (ties ->
    faster, then name: every replica ranks alike)."""
    out = [(s, ms) for s in sites if (ms := row_ms(meta, s.hardware_class)) is not None and ms > 0]
    return sorted(out, key=lambda p: (p[1] * p[0].price_per_core_hour, p[1], p[0].site))


def _load_s(meta: VariantMeta) -> float:
    return max((p.load_ms for p in meta.profiles.values()), default=0.0) / 1000.0


def _finish_s(rows: int, chunks: int, ms: Sequence[float], load_s: float, harvest: float = HARVEST) -> float:
    """The projected time for sites of per-row compute ``ms`` together to finish ``rows`` in ``chunks``."""
    rate = sum(harvest * 1000.0 / m for m in ms)
    return SAFETY * (rows / rate + chunks * CHUNK_OVERHEAD_S / len(ms) + load_s)


def _sites_needed(rows: int, chunks: int, ms: Sequence[float], load_s: float, within_s: float,
                  harvest: float = HARVEST) -> tuple[int, float]:
    """How many of the ranked sites (a prefix) finish within ``within_s``, and when; all of them when none does."""
    for k in range(1, len(ms) + 1):
        seconds = _finish_s(rows, chunks, ms[:k], load_s, harvest)
        if seconds <= within_s:
            return k, seconds
    return len(ms), _finish_s(rows, chunks, ms, load_s, harvest)


def _pool(sites: Iterable[Capacity]) -> list[Capacity]:
    caps = list(sites)
    return [s for s in caps if s.idle] or caps  # a mesh busy now still has its capacity over hours


def job_variant(metas: Iterable[VariantMeta], tenant: str, chosen: str | None,
                min_accuracy: float) -> VariantMeta | None:
    """The variant a job runs on: the one chosen at admission while the catalog still has it for ``tenant`` at
    ``min_accuracy``, else the cheapest that meets it now."""
    ok = job_candidates(metas, tenant)
    return next((m for m in ok if m.variant_id == chosen and m.accuracy >= min_accuracy), None) \
        or cheapest_variant(ok, min_accuracy)


def estimate(rows: int, chunks: int, meta: VariantMeta, sites: Iterable[Capacity]) -> Estimate | None:
    """The job on every idle site of ``sites`` together (all of them when none is idle): ``seconds`` is the best
    deadline admission can promise; ``cost`` every row on the site cheapest per row, the least any plan costs.
    None with no site or no profile."""
    ranked = _ranked(meta, _pool(sites))
    if not ranked:
        return None
    load_s = _load_s(meta)
    seconds = _finish_s(rows, chunks, [ms for _, ms in ranked], load_s)
    cheap, ms = ranked[0]
    cost = SAFETY * (rows * ms / 1000.0 + chunks * CHUNK_OVERHEAD_S + load_s) * cheap.price_per_core_hour / 3600.0
    return Estimate(meta.variant_id, cheap.site, seconds, cost, tuple(c.site for c, _ in ranked))


def cheapest_plan(rows: int, chunks: int, meta: VariantMeta, sites: Iterable[Capacity],
                  within_s: float) -> Estimate | None:
    """The fewest, cheapest sites whose projection meets ``within_s`` (all when none does: then ``seconds`` is over
    it), and the plan's cost: each site's share of rows in proportion to its throughput, priced at its rate."""
    ranked = _ranked(meta, _pool(sites))
    if not ranked:
        return None
    load_s = _load_s(meta)
    k, seconds = _sites_needed(rows, chunks, [ms for _, ms in ranked], load_s, within_s)
    used = ranked[:k]
    rate = sum(1.0 / ms for _, ms in used)
    cost = sum(SAFETY * ((rows * ms / 1000.0 + chunks * CHUNK_OVERHEAD_S) / (ms * rate) + load_s)
               * cap.price_per_core_hour / 3600.0 for cap, ms in used)
    return Estimate(meta.variant_id, used[0][0].site, seconds, cost, tuple(c.site for c, _ in used))


def may_claim(me: str, sites: Iterable[Capacity], queued_for_s: float) -> bool:
    """Whether site ``me`` should claim a chunk now: it is idle and among the cheapest idle sites (within
    ``PRICE_SLACK``), or the chunk has waited ``CLAIM_GRACE_S`` (the cheapest are busy or gone)."""
    caps = {s.site: s for s in sites}
    mine = caps.get(me)
    if mine is None or not mine.idle:
        return False
    if queued_for_s >= CLAIM_GRACE_S:
        return True
    cheapest = min(s.price_per_core_hour for s in caps.values() if s.idle)
    return mine.price_per_core_hour <= cheapest * PRICE_SLACK


class Beat(Protocol):
    """What a heartbeat says that the idleness rule reads (``core_scheduler.state.heartbeat.Heartbeat``)."""

    @property
    def inflight(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def hardware_class(self) -> str | None: ...


IDLE_FRACTION = 0.5  # a site whose last heartbeat shows online work in flight past this share of capacity is busy


def job_candidates(metas: Iterable[VariantMeta], tenant: str) -> list[VariantMeta]:
    """The variants a job of ``tenant`` may run on: public ones and its own (a head on a shared backbone too: a
    chunk runs the backbone's session and then the head's, outside the online batcher, ``edge_agent.chunk_run``)."""
    return [m for m in metas if m.owner in (PUBLIC, tenant)]


def capacities(sites: Mapping[str, Site], live: Mapping[str, Beat]) -> list[Capacity]:
    """Live sites (in the topology and heartbeating) as chunk capacity: price per core-hour from the topology,
    hardware class and idleness from the heartbeat."""
    out = []
    for name, hb in live.items():
        site = sites.get(name)
        if site is None:
            continue
        cores = max(1, site.hardware.cpu_cores)
        idle = hb.inflight <= IDLE_FRACTION * max(1, hb.capacity)
        out.append(Capacity(name, hb.hardware_class, site.hardware.price_per_hour / cores, idle))
    return out


@dataclass(frozen=True, slots=True)
class Assigned:
    """A chunk's standing assignment (``jobassign/<id>/<n>``): to ``site``, first handed out at ``since``, last
    renewed at ``at`` (the leader's wall clock, epoch seconds)."""

    site: str
    since: float
    at: float


@dataclass(frozen=True, slots=True)
class JobWork:
    """A live job as the assignment plan sees it: its unclaimed queued chunks ``(index, rows)``, the rows and chunks
    not done yet (running ones too), its variant (None: none known, so no projection) and deadline."""

    job_id: str
    deadline: float
    meta: VariantMeta | None
    queued: tuple[tuple[int, int], ...]
    rows_left: int
    chunks_left: int


@dataclass(frozen=True, slots=True)
class AssignPlan:
    """The assignments that should stand (kept, renewed or new), by ``(job, chunk)``; per job the sites its deadline
    needs, cheapest first; and the jobs no set of idle sites finishes in time (given every idle site)."""

    chunks: dict[tuple[str, int], Assigned]
    sites: dict[str, tuple[str, ...]]
    late: frozenset[str]


def _ahead(ms: float | None, chunk_rows: float, harvest: float, horizon_s: float) -> int:
    """How many chunks a site should hold to stay busy until the next round reaches it."""
    if ms is None:
        return MIN_AHEAD
    chunk_s = chunk_rows * ms / 1000.0 / harvest + CHUNK_OVERHEAD_S
    return max(MIN_AHEAD, min(MAX_AHEAD, math.ceil(horizon_s / chunk_s)))


def assign(jobs: Sequence[JobWork], sites: Iterable[Capacity], current: Mapping[tuple[str, int], Assigned],
           running: Mapping[str, int], now: float, *, harvest: float = HARVEST,
           horizon_s: float = HORIZON_S) -> AssignPlan:
    """The leader's plan for one round. ``sites``: the live ones; ``current``: the assignments read back;
    ``running``: chunks each site holds a claim on now (all jobs)."""
    caps = {s.site: s for s in sites}
    held = dict(running)  # chunks in each site's hands: its running claims plus its standing assignments
    out: dict[tuple[str, int], Assigned] = {}
    for job in jobs:  # what still stands first, so a round never reshuffles work a site was about to take
        for idx, _ in job.queued:
            a = current.get((job.job_id, idx))
            if a is None or a.site not in caps:
                continue  # none, or its site left: the chunk is free again
            if now - a.since >= HOLD_S and not running.get(a.site):
                continue  # held, never taken, by a site running nothing (busy online, or stuck)
            out[(job.job_id, idx)] = a if now - a.at < RENEW_S else Assigned(a.site, a.since, now)
            held[a.site] = held.get(a.site, 0) + 1
    needed: dict[str, tuple[str, ...]] = {}
    late: set[str] = set()
    idle = [c for c in caps.values() if c.idle]
    for job in sorted(jobs, key=lambda j: (j.deadline, j.job_id)):
        ranked: list[tuple[Capacity, float | None]]
        if job.meta is not None and (known := _ranked(job.meta, idle)):
            k, seconds = _sites_needed(job.rows_left, job.chunks_left, [ms for _, ms in known], _load_s(job.meta),
                                       job.deadline - now, harvest)
            if seconds > job.deadline - now:
                late.add(job.job_id)
            ranked = list(known[:k])
        else:  # no profile: the cheapest idle site by price alone, as admission could not project it either
            ranked = [(c, None) for c in sorted(idle, key=lambda c: (c.price_per_core_hour, c.site))[:1]]
        needed[job.job_id] = tuple(c.site for c, _ in ranked)
        free = [(idx, rows) for idx, rows in job.queued if (job.job_id, idx) not in out]
        if not free:
            continue
        mean_rows = sum(r for _, r in free) / len(free)
        for cap, ms in ranked:
            limit = _ahead(ms, mean_rows, harvest, horizon_s)
            while free and held.get(cap.site, 0) < limit:
                idx, _ = free.pop(0)
                out[(job.job_id, idx)] = Assigned(cap.site, now, now)
                held[cap.site] = held.get(cap.site, 0) + 1
    return AssignPlan(out, needed, frozenset(late))


def claim_choice(me: str, queued: Sequence[int], assigned: Mapping[int, Assigned], sites: Iterable[Capacity],
                 now: float, job_age_s: float) -> int | None:
    """Which of a job's unclaimed queued chunks site ``me`` should claim now: the first assigned to it; while the
    leader leads the job (an assignment renewed within ``ASSIGN_GRACE_S``) nothing else; otherwise, as before any
    leader planned, the first chunk by ``may_claim``. None: none."""
    mine = [i for i in queued if (a := assigned.get(i)) is not None and a.site == me]
    if mine:
        return min(mine)
    if any(now - a.at < ASSIGN_GRACE_S for a in assigned.values()):
        return None
    if queued and may_claim(me, sites, job_age_s):
        return min(queued)
    return None
