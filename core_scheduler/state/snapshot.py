"""Turn an agent's cached view into the policies' immutable ``MeshSnapshot``.

A site's hardware class is the one its heartbeat reports (what it really runs on: a core site
without a GPU says ``cpu-...``), falling back to the class the topology declares. Profiles are
keyed by real hardware classes, so a site is never credited with hardware it does not have. A class
the catalog has no profile for (a site under a CPU cap of its own) takes the timings its sites measured
themselves and published in their heartbeats, until the catalog has one. Until a site has (the first
minute of a capped mesh) it is estimated from the classes that are measured (``with_estimates`` of
:mod:`core_scheduler.policy.snapshot`: the uncapped machine scaled by the cap), never treated as absent.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from core_scheduler.policy.snapshot import (
    MeshSnapshot,
    SiteInfo,
    SiteLoad,
    VariantInfo,
    tail_margin_ms,
    with_estimates,
)
from core_scheduler.state.heartbeat import Heartbeat
from core_scheduler.state.view import MeshView
from topology.paths import PathTables, topology_paths
from topology.schema import Topology
from variant_store.cascade_meta import CascadeMeta

__all__ = ["SnapshotBuilder", "build_snapshot", "site_load_from_record"]


def site_load_from_record(site: str, rec: Heartbeat) -> SiteLoad:
    return SiteLoad(site=site, loaded=frozenset(rec.loaded),
                    queue_ms={v: lv.queue_ms for v, lv in rec.loaded.items()},
                    inflight=rec.inflight, capacity=rec.capacity,
                    memory_free_bytes=rec.memory_free_bytes, degraded=False)


def build_snapshot(view: MeshView, *, here: str | None = None,
                   local_loads: Heartbeat | None = None,
                   rtt_correction: dict[str, float] | None = None) -> MeshSnapshot | None:
    """``None`` until a topology and at least one task are known. A one-off build; a process that
    rebuilds on every change keeps a :class:`SnapshotBuilder`, which redoes only what changed.

    ``rtt_correction``: extra round-trip ms ``here`` has observed to each site beyond what the
    topology's link latencies predict (serialisation, proxies, event-loop delays); added to the
    RTT table's row and column of ``here`` so routing plans with what paths really cost.
    """
    return SnapshotBuilder(view, here=here).build(local_loads=local_loads, rtt_correction=rtt_correction)


class SnapshotBuilder:
    """Snapshots of one view, each rebuilt from the last one and what the view says changed.

    A heartbeat (most changes) replaces one site's ``SiteInfo`` and ``SiteLoad``; the path tables, their
    tail margins, the variants and the placement map are reused until the topology, the catalog or the
    placements change (the view counts changes per kind), and the path tables are looked up only when
    the topology object changes (a new topology revision). So a rebuild on a heartbeat costs a few dict
    copies, not a pass over every site and link. A full re-read of the view (``generation``) starts over.
    """

    def __init__(self, view: MeshView, *, here: str | None = None) -> None:
        self.view = view
        self.here = here
        self._topo: Topology | None = None
        self._gen = -1
        self._paths: PathTables | None = None
        self._margin: NDArray[np.float64] | None = None
        self._sites: dict[str, SiteInfo] = {}
        self._loads: dict[str, SiteLoad] = {}
        self._live_rev: dict[str, int] = {}
        self._measured: dict[str, tuple[str | None, tuple[str, ...]] | None] = {}  # site -> profiled class, vids
        self._measured_rev = 0
        self._classes_rev = 0  # bumped when a site's hardware class changes: the estimates depend on them
        self._variants_key: tuple[int, int, int, int, int] | None = None
        self._variants: dict[str, tuple[VariantInfo, ...]] = {}
        self._placement_key: tuple[int, int] | None = None
        self._placement: dict[str, frozenset[str]] = {}
        self._cascades_key: tuple[int, int, int] | None = None
        self._cascades: dict[str, dict[str, CascadeMeta]] = {}
        self._rtt_key: tuple[int, tuple[tuple[str, float], ...]] | None = None
        self._rtt: NDArray[np.float64] | None = None
        self.path_lookups = 0   # path tables looked up (topology changes), and per-site updates
        self.site_updates = 0

    def _site(self, name: str, rec: Heartbeat | None) -> None:
        assert self._topo is not None
        s = self._topo.sites[name]
        hw = (rec.hardware_class if rec else None) or s.hardware.hardware_class
        prev = self._sites.get(name)
        if prev is None or prev.hardware_class != hw:
            self._classes_rev += 1
        self._sites[name] = SiteInfo(name=name, tier=s.tier, region=s.region, hardware_class=hw,
                                     cpu_cores=s.hardware.cpu_cores, memory_mb=s.hardware.memory_mb,
                                     gpus=len(s.hardware.gpus) if rec is not None and rec.gpu else 0,
                                     price_per_hour=s.hardware.price_per_hour, alive=rec is not None,
                                     device_budget_bytes=rec.device_memory_budget_bytes if rec is not None else 0)
        if rec is None:
            self._loads.pop(name, None)
        else:
            self._loads[name] = site_load_from_record(name, rec)
        measured = (rec.hardware_class, tuple(sorted(rec.profiles))) if rec is not None and rec.profiles else None
        if self._measured.get(name) != measured:
            self._measured[name] = measured
            self._measured_rev += 1
        self.site_updates += 1

    def _topology_changed(self, topo: Topology) -> None:
        self._topo = topo
        self.path_lookups += 1
        # cached by the topology's content: a tenant change finds the tables it had
        paths = topology_paths(topo)
        if paths is not self._paths:
            self._paths = paths
            self._margin = tail_margin_ms(paths.rtt_ms, paths.jitter_rtt_ms)
            self._rtt_key = None
        self._sites, self._loads, self._live_rev = {}, {}, {}
        for name in sorted(topo.sites):
            self._site(name, None)

    def build(self, *, local_loads: Heartbeat | None = None,
              rtt_correction: dict[str, float] | None = None) -> MeshSnapshot | None:
        """The snapshot of the view now (see :func:`build_snapshot` for the arguments)."""
        view = self.view
        topo = view.topology
        if topo is None or not view.variants:
            return None
        if topo is not self._topo or view.generation != self._gen:
            self._gen = view.generation
            self._topology_changed(topo)
        assert self._paths is not None and self._margin is not None
        here = self.here
        # heartbeats that changed since the last build (the view keeps the revision of each it holds)
        live, revs = view.live, view.live_revision
        for name in [n for n in self._live_rev if n not in live]:
            self._live_rev.pop(name)
            if name in topo.sites:
                self._site(name, None)
        for name, rev in revs.items():
            if self._live_rev.get(name) != rev and name in topo.sites and name in live:
                self._live_rev[name] = rev
                self._site(name, live[name])
        if here is not None and local_loads is not None and here in topo.sites:
            # we are alive and know our load better than our last heartbeat does, and before the
            # first one has come back through the watch (tables built then would count us dead)
            self._live_rev[here] = -1  # our heartbeat, when it comes back, is applied again
            self._site(here, local_loads)
        # strict tenants come from the topology; timings a capped site measured itself from its heartbeat
        vkey = (view.generation, view.revisions.get("variant", 0), id(topo), self._measured_rev, self._classes_rev)
        if vkey != self._variants_key:
            self._variants_key = vkey
            by_task: dict[str, list[VariantInfo]] = {}
            metas = [m for vs in view.variants.values() for m in vs.values()]
            # a head carries its backbone's memory; a strict tenant's head a whole backbone of its own
            blob_bytes = {m.blob_digest: VariantInfo.from_meta(m).memory_bytes for m in metas}
            strict = {t.name for t in topo.tenants.values() if t.isolation == "strict"}
            infos = [VariantInfo.from_meta(m, base_bytes=blob_bytes.get(m.shared_base_digest or "", 0),
                                           isolated=m.owner in strict) for m in metas]
            records = dict(live)
            if here is not None and local_loads is not None:
                records[here] = local_loads
            infos = _with_measured(infos, [records[n] for n in sorted(records) if n in topo.sites])
            infos = with_estimates(infos, {s.hardware_class for s in self._sites.values()})
            for v in sorted(infos, key=lambda v: (v.task, v.variant_id)):
                by_task.setdefault(v.task, []).append(v)
            self._variants = {t: tuple(vs) for t, vs in by_task.items()}
        ckey = (view.generation, view.revisions.get("cascade", 0), view.revisions.get("variant", 0))
        if ckey != self._cascades_key:  # a cascade is kept only while every stage is a variant of its task
            self._cascades_key = ckey
            served = {t: {v.variant_id for v in vs} for t, vs in self._variants.items()}
            self._cascades = {t: kept for t, cs in view.cascades.items()
                              if (kept := {i: c for i, c in cs.items() if set(c.stages) <= served.get(t, set())})}
        key = (view.generation, view.revisions.get("placement", 0))
        if key != self._placement_key:
            self._placement_key = key
            self._placement = {site: frozenset(v["variant_id"] for v in (p.get("variants") or []))
                               for site, p in view.placement.items()}
        return self._snapshot(rtt_correction)

    def _snapshot(self, rtt_correction: dict[str, float] | None) -> MeshSnapshot:
        paths, view = self._paths, self.view
        assert paths is not None
        index = paths.index
        rtt = paths.rtt_ms
        here = self.here
        if here is not None and rtt_correction and here in index:
            ckey = (id(paths), tuple(sorted(rtt_correction.items())))
            if ckey != self._rtt_key or self._rtt is None:
                rtt = rtt.copy()  # the cached table is shared
                h = index[here]
                for site, extra in rtt_correction.items():
                    if site in index and site != here:
                        rtt[h, index[site]] += extra
                        rtt[index[site], h] += extra
                self._rtt_key, self._rtt = ckey, rtt
            rtt = self._rtt
        svc = view.services.get("variant-store")
        store_site = svc.get("site") if isinstance(svc, dict) else None
        placement = dict(self._placement)
        for name, ld in self._loads.items():
            placement.setdefault(name, ld.loaded)
        return MeshSnapshot(version=view.revision, sites=dict(self._sites),
                            variants=self._variants, loads=dict(self._loads),
                            rtt_ms=rtt, bandwidth_mbps=paths.bandwidth_mbps, site_index=index,
                            placement=placement, margin_ms=self._margin, cascades=self._cascades,
                            store_site=store_site if isinstance(store_site, str) and store_site in index else None)


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

