"""The baselines tiermesh is measured against, as routing/placement modes (pure functions).

Each baseline is tiermesh's own cost model run over a *restricted view* of the snapshot, so the
benchmarks compare policies, not implementations: the same feasibility test, best-effort rules,
reason codes and reply flags apply to every system.

- ``edge-only``  router: only candidates at ``here`` (cheapest feasible, else best effort).
                 placer: every edge holds every variant that fits its model memory, smallest
                 first; middle and core sites hold nothing.
- ``core-only``  router: only the core tier and, per task, the core's best variant (the most
                 accurate public one, or private one for a task that has no public variant; ties by
                 less compute). placer: the core holds it.
- ``static``     one pinned variant per task everywhere, as a Triton user would deploy it: the
                 most accurate public variant whose batch-1 compute is within ``STATIC_COMPUTE_FACTOR``
                 (2x) of the fastest variant's on that hardware (a mid-size model, not the
                 smallest nor the slowest). router: serve it at ``here``. placer: every site holds it.
- ``infaas``     INFaaS-style: cheapest variant meeting the SLO, decided without network-path
                 awareness (every reachable site looks zero RTT, infinite bandwidth); placement is
                 reactive only: ``plan_placement`` over the *current* demand (forecast stripped),
                 also network-blind, on top of the same warm floor tiermesh starts from (so the
                 comparison isolates path awareness and forecasting, not the floor).

``ROUTERS`` and ``PLACERS`` here are the baselines' half of ``core_scheduler.policy.modes``' registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from core_scheduler.policy.placement import Demand, plan_placement
from core_scheduler.policy.routing import RoutingTable
from core_scheduler.policy.snapshot import MeshSnapshot, VariantInfo

__all__ = [
    "BASELINES",
    "STATIC_COMPUTE_FACTOR",
    "best_core_variant",
    "core_only_placer",
    "core_only_router",
    "edge_only_placer",
    "edge_only_router",
    "infaas_placer",
    "infaas_router",
    "network_blind",
    "restrict",
    "static_placer",
    "static_router",
    "static_variant",
]

BASELINES = ("edge-only", "core-only", "static", "infaas")
STATIC_COMPUTE_FACTOR = 2.0
# share of a site's memory its models may take (the agent's default) and of that what a plan uses
_MODEL_MEMORY_FRACTION = 0.25
_HEADROOM = 0.8
_PRECISION_RANK = {"int8": 0, "fp16": 1, "fp32": 2}

PerSite = dict[str, tuple[str, ...]]


# ------------------------------------------------------------------ snapshot views


def restrict(snap: MeshSnapshot, *, sites: Iterable[str] | None = None,
             variants: Mapping[str, Iterable[str]] | None = None) -> MeshSnapshot:
    """``snap`` where only ``sites`` are alive and, per task in ``variants``, only those variant
    ids exist (tasks not named keep theirs). Path tables and heartbeats are kept as they are."""
    keep_sites = set(snap.sites) if sites is None else set(sites)
    site_map = {n: (s if n in keep_sites else dataclasses.replace(s, alive=False))
                for n, s in snap.sites.items()}
    loads = {n: ld for n, ld in snap.loads.items() if n in keep_sites}
    vs = dict(snap.variants)
    for task, ids in (variants or {}).items():
        wanted = set(ids)
        vs[task] = tuple(v for v in snap.variants.get(task, ()) if v.variant_id in wanted)
    return MeshSnapshot(version=snap.version, sites=site_map, variants=vs, loads=loads,
                        rtt_ms=snap.rtt_ms, bandwidth_mbps=snap.bandwidth_mbps,
                        site_index=snap.site_index, placement=snap.placement)


def network_blind(snap: MeshSnapshot) -> MeshSnapshot:
    """``snap`` with every reachable path at zero RTT and infinite bandwidth (unreachable stays
    unreachable: liveness and partitions are still known, distance is not)."""
    rtt = np.where(np.isfinite(snap.rtt_ms), 0.0, np.inf)
    bw = np.where(snap.bandwidth_mbps > 0, np.inf, 0.0)
    return dataclasses.replace(snap, rtt_ms=rtt, bandwidth_mbps=bw)


def _hardware_classes(snap: MeshSnapshot, tier: str | None = None) -> list[str]:
    return sorted({s.hardware_class for s in snap.sites.values() if tier is None or s.tier == tier})


def _public(snap: MeshSnapshot, task: str, hw: str) -> list[VariantInfo]:
    """The variants a deployment would pin for ``task``: its public ones; for a task whose variants are
    all private (a tenant's own task, such as its head on a shared encoder), those: a core-only or static
    deployment serves a tenant's own models too (routing still admits only the tenant they belong to)."""
    runnable = [v for v in snap.variants.get(task, ()) if v.runs_on(hw)]
    return [v for v in runnable if v.owner == "public"] or runnable


def best_core_variant(snap: MeshSnapshot, task: str) -> VariantInfo | None:
    """The most accurate public variant that runs on a core site's hardware (ties: less compute)."""
    best: tuple[float, float, str] | None = None
    pick: VariantInfo | None = None
    for hw in _hardware_classes(snap, "core"):
        for v in _public(snap, task, hw):
            key = (-v.accuracy, v.compute_at(hw), v.variant_id)
            if best is None or key < best:
                best, pick = key, v
    return pick


def static_variant(snap: MeshSnapshot, task: str, hardware_class: str,
                   factor: float = STATIC_COMPUTE_FACTOR) -> VariantInfo | None:
    """The variant a Triton user would pin: most accurate public variant whose batch-1 compute on
    ``hardware_class`` is within ``factor`` x the fastest's (ties: faster, then smaller)."""
    public = _public(snap, task, hardware_class)
    if not public:
        return None
    fastest = min(v.compute_at(hardware_class) for v in public)
    limit = fastest * factor
    return max((v for v in public if v.compute_at(hardware_class) <= limit),
               key=lambda v: (v.accuracy, -v.compute_at(hardware_class), -v.size_bytes, v.variant_id))


def _static_ids(snap: MeshSnapshot, hw: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for task in snap.variants:
        v = static_variant(snap, task, hw)
        out[task] = [v.variant_id] if v is not None else []
    return out


# ------------------------------------------------------------------ routers


def edge_only_router(snap: MeshSnapshot, here: str) -> RoutingTable:
    return RoutingTable.build(restrict(snap, sites=[here]), here)


def core_only_router(snap: MeshSnapshot, here: str) -> RoutingTable:
    cores = [n for n, s in snap.sites.items() if s.tier == "core"]
    best = {task: [v.variant_id] if (v := best_core_variant(snap, task)) is not None else []
            for task in snap.variants}
    return RoutingTable.build(restrict(snap, sites=cores, variants=best), here)


def static_router(snap: MeshSnapshot, here: str) -> RoutingTable:
    hw = snap.sites[here].hardware_class if here in snap.sites else ""
    return RoutingTable.build(restrict(snap, sites=[here], variants=_static_ids(snap, hw)), here)


def infaas_router(snap: MeshSnapshot, here: str) -> RoutingTable:
    return RoutingTable.build(network_blind(snap), here)


# ------------------------------------------------------------------ placers


def edge_only_placer(snap: MeshSnapshot, floor: PerSite, planned: PerSite, demand: Any) -> PerSite:
    out: PerSite = {}
    for name in sorted(snap.sites):
        site = snap.sites[name]
        if site.tier != "edge":
            out[name] = ()
            continue
        hw = site.hardware_class
        cap = site.memory_bytes * _MODEL_MEMORY_FRACTION * _HEADROOM
        pool = [v for vs in snap.variants.values() for v in vs if v.runs_on(hw)]
        pool.sort(key=lambda v: (v.memory_bytes, _PRECISION_RANK.get(v.precision, 3), v.compute_at(hw),
                                 v.variant_id))
        used = 0
        chosen: list[str] = []
        for v in pool:
            if used + v.memory_bytes <= cap:
                chosen.append(v.variant_id)
                used += v.memory_bytes
        out[name] = tuple(sorted(chosen))
    return out


def core_only_placer(snap: MeshSnapshot, floor: PerSite, planned: PerSite, demand: Any) -> PerSite:
    best = sorted(v.variant_id for task in snap.variants if (v := best_core_variant(snap, task)) is not None)
    return {name: tuple(best) if s.tier == "core" else () for name, s in sorted(snap.sites.items())}


def static_placer(snap: MeshSnapshot, floor: PerSite, planned: PerSite, demand: Any) -> PerSite:
    out: PerSite = {}
    for name in sorted(snap.sites):
        ids = _static_ids(snap, snap.sites[name].hardware_class)
        out[name] = tuple(sorted(vid for vs in ids.values() for vid in vs))
    return out


def infaas_placer(snap: MeshSnapshot, floor: PerSite, planned: PerSite, demand: Any) -> PerSite:
    """Reactive: only demand observed now (forecasts dropped), network-blind. Without the
    scheduler's usage clocks every placed pair counts as just loaded, so nothing is evicted
    during a run: reactive scale-out only, as INFaaS does within a benchmark's span."""
    current = [dataclasses.replace(d, forecast_qps=0.0) for d in (demand or ())
               if isinstance(d, Demand) and d.qps > 0]
    plan = plan_placement(network_blind(snap), current, 0.0, {}, {}, pinned=floor)
    out = {s: set(vs) for s, vs in plan.per_site.items()}
    for s, vs in floor.items():
        out.setdefault(s, set()).update(vs)
    return {s: tuple(sorted(vs)) for s, vs in sorted(out.items())}


ROUTERS: dict[str, Callable[[MeshSnapshot, str], RoutingTable]] = {
    "edge-only": edge_only_router, "core-only": core_only_router, "static": static_router, "infaas": infaas_router}
PLACERS: dict[str, Callable[[MeshSnapshot, PerSite, PerSite, Any], PerSite]] = {
    "edge-only": edge_only_placer, "core-only": core_only_placer, "static": static_placer, "infaas": infaas_placer}
