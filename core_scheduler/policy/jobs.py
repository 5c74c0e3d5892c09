"""Offline jobs' policies, pure: which variant runs a job, whether its deadline and cost ceiling can be met, and
whether a site should claim a chunk now.

Units and conventions: compute from the catalog's measured profiles (``Profile.compute_ms`` at the largest batch
profiled, per row); prices are the topology's USD per hour for a site's whole hardware, spread evenly over its
cores (a chunk worker runs one batch at a time, on about one core); times in seconds.

The estimate is deliberately simple and conservative: one site (the cheapest that can run it) does the whole job
serially, with a safety factor, since the harvested capacity is whatever the online load leaves. Spreading the
estimate over the idle capacity of several sites is for the leader-driven assignment (not built yet).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from topology.schema import Site
from variant_store.meta import PUBLIC, VariantMeta

__all__ = ["SAFETY", "Beat", "Capacity", "Estimate", "capacities", "cheapest_variant", "estimate", "job_candidates",
           "may_claim", "row_ms"]

SAFETY = 2.0              # the estimate's margin: harvested capacity comes and goes with the online load
CHUNK_OVERHEAD_S = 0.25   # per chunk: claim + commit in etcd, input read, output upload (measured ~0.1 s here)
CLAIM_GRACE_S = 10.0      # a chunk left queued this long may be claimed by any idle site, cheapest or not
PRICE_SLACK = 1.05        # sites within 5 % of the cheapest count as cheapest


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
    """How long (``seconds``, with ``SAFETY``) and how much (``cost``, USD) a job takes on the cheapest capacity."""

    variant: str
    site: str
    seconds: float
    cost: float


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


def estimate(rows: int, chunks: int, meta: VariantMeta, sites: Iterable[Capacity]) -> Estimate | None:
    """The job's time and cost on the cheapest of ``sites`` (ties -> fastest); None with no site or no profile."""
    best: Estimate | None = None
    for s in sites:
        ms = row_ms(meta, s.hardware_class)
        if ms is None:
            continue
        load_s = max((p.load_ms for p in meta.profiles.values()), default=0.0) / 1000.0
        seconds = SAFETY * (rows * ms / 1000.0 + chunks * CHUNK_OVERHEAD_S + load_s)
        cost = seconds * s.price_per_core_hour / 3600.0
        if best is None or (cost, seconds) < (best.cost, best.seconds):
            best = Estimate(meta.variant_id, s.site, seconds, cost)
    return best


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
    """The variants a job of ``tenant`` may run on: public ones and its own, with no shared backbone (a chunk runs
    its variant's runtime directly, outside the online batcher a backbone's heads share)."""
    return [m for m in metas if m.owner in (PUBLIC, tenant) and not m.shared_base_digest]


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
