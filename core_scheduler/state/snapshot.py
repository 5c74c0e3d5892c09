"""Turn an agent's cached view into the policies' immutable ``MeshSnapshot``.

A site's hardware class is the one its heartbeat reports (what it really runs on: a core site
without a GPU says ``cpu-...``), falling back to the class the topology declares. Profiles are
keyed by real hardware classes, so a site is never credited with hardware it does not have. A class
the catalog has no profile for (a site under a CPU cap of its own) takes the timings its sites measured
themselves and published in their heartbeats, until the catalog has one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from core_scheduler.policy.snapshot import (
    MeshSnapshot,
    SiteInfo,
    SiteLoad,
    VariantInfo,
    tail_margin_ms,
)
from core_scheduler.state.heartbeat import Heartbeat
from core_scheduler.state.view import MeshView
from topology.paths import topology_paths

__all__ = ["build_snapshot", "site_load_from_record"]


def site_load_from_record(site: str, rec: Heartbeat) -> SiteLoad:
    return SiteLoad(site=site, loaded=frozenset(rec.loaded),
                    queue_ms={v: lv.queue_ms for v, lv in rec.loaded.items()},
                    inflight=rec.inflight, capacity=rec.capacity,
                    memory_free_bytes=rec.memory_free_bytes, degraded=False)


def build_snapshot(view: MeshView, *, here: str | None = None,
                   local_loads: Heartbeat | None = None,
                   rtt_correction: dict[str, float] | None = None) -> MeshSnapshot | None:
    """``None`` until a topology and at least one task are known.

    ``rtt_correction``: extra round-trip ms ``here`` has observed to each site beyond what the
    topology's link latencies predict (serialisation, proxies, event-loop delays); added to the
    RTT table's row and column of ``here`` so routing plans with what paths really cost.
    """
    topo = view.topology
    if topo is None or not view.variants:
        return None
    live = dict(view.live)
    if here is not None and local_loads is not None and here in topo.sites:
        # we are alive and know our load better than our last heartbeat does, and before the
        # first one has come back through the watch (tables built then would count us dead)
        live[here] = local_loads
    sites = []
    for name, s in topo.sites.items():
        rec = live.get(name)
        hw = (rec.hardware_class if rec else None) or s.hardware.hardware_class
        sites.append(SiteInfo(name=name, tier=s.tier, region=s.region, hardware_class=hw,
                              cpu_cores=s.hardware.cpu_cores, memory_mb=s.hardware.memory_mb,
                              gpus=len(s.hardware.gpus) if rec is not None and rec.gpu else 0,
                              price_per_hour=s.hardware.price_per_hour, alive=True))
    variants = _with_measured([VariantInfo.from_meta(m) for vs in view.variants.values() for m in vs.values()],
                              live.values())
    loads = []
    for name, rec in live.items():
        if name in topo.sites:
            loads.append(site_load_from_record(name, rec))
    links = [(lk.a, lk.b, lk.latency_ms, lk.bandwidth_mbps) for lk in topo.links]
    placement = {site: [v["variant_id"] for v in (p.get("variants") or [])]
                 for site, p in view.placement.items()}
    # sites with no heartbeat are dead: from_parts would invent an idle heartbeat for them
    alive = {ld.site for ld in loads}
    sites = [SiteInfo(**{**_fields(s), "alive": s.name in alive}) for s in sites]
    # cached by the topology's content: a heartbeat (most view changes) reuses the tables
    paths = topology_paths(topo)
    index = paths.index
    rtt, bw = paths.rtt_ms, paths.bandwidth_mbps
    margin = tail_margin_ms(rtt, paths.jitter_rtt_ms)
    if here is not None and rtt_correction and here in index:
        rtt = rtt.copy()  # the cached table is shared
        h = index[here]
        for site, extra in rtt_correction.items():
            if site in index and site != here:
                rtt[h, index[site]] += extra
                rtt[index[site], h] += extra
    svc = view.services.get("variant-store")
    store_site = svc.get("site") if isinstance(svc, dict) else None
    return MeshSnapshot.from_parts(sites, variants, loads, links, rtt_ms=rtt, bandwidth_mbps=bw,
                                   placement=placement, margin_ms=margin,
                                   store_site=store_site if isinstance(store_site, str) else None,
                                   version=view.revision)


def _with_measured(variants: list[VariantInfo], records: Any) -> list[VariantInfo]:
    """``variants`` with the self-measured profiles of heartbeats added for classes the catalog lacks
    (the first site of a class to publish one is used: same class, same cap, same machine)."""
    extra: dict[str, dict[str, Any]] = {}
    for rec in records:
        hw = rec.hardware_class
        if hw:
            for vid, prof in rec.profiles.items():
                extra.setdefault(vid, {}).setdefault(hw, prof)
    if not extra:
        return variants
    out = []
    for v in variants:
        add = {hw: p for hw, p in extra.get(v.variant_id, {}).items() if hw not in v.compute_ms}
        if add:
            v = replace(v, compute_ms={**v.compute_ms, **{hw: dict(p.p50_ms) for hw, p in add.items()}},
                        load_ms={**v.load_ms, **{hw: p.load_ms for hw, p in add.items()}})
        out.append(v)
    return out


def _fields(s: SiteInfo) -> dict[str, Any]:
    return {f: getattr(s, f) for f in SiteInfo.__dataclass_fields__}
