"""Placement: which variants each site should hold. The scheduler leader's decision, pure.

Input is a snapshot, the demand per (site, task, SLO class) (observed, optionally with a
forecast), the time, when each (site, variant) was last used and since when it is loaded.
Output is the desired variant set per site and one :class:`PlacementEvent` per change, each
with a reason a person can read. Same inputs, same plan: everything is iterated in sorted order.

Steps, following INFaaS (prefer what is loaded; scale a variant out before buying hardware):

1. *Cover.* Each demand needs some (site, variant) that meets its SLO from the demand's site:
   ``rtt(site, s) + compute(v, hw(s), rows) <= budget_ms`` and ``accuracy >= min_accuracy``
   (and the tenant may use it; ``rows`` is the most rows one of its requests brings: a site that answers
   one row in time may not answer 64). One already placed wins. Otherwise load one: at the demand's own
   site if it fits (on an edge, smallest / INT8 first), else at the nearest middle or core site
   (then other edges). Memory: the planned variants of a site stay within ``headroom`` of its
   memory (on a GPU site with a known device budget, the smaller of the two: its variants hold their
   weights on the device), a backbone shared by several heads counted once (a strict tenant's head
   carries a whole backbone of its own: ``VariantInfo.base``); to fit, idle variants past their minimum residency
   are evicted, least recently used first. When nothing meets the SLO and no variant of the task is
   placed anywhere alive, the lowest-latency variant meeting the accuracy floor (else any) is
   loaded: traffic is never left without a server.
2. *Replicate.* A variant serving ``qps`` needs ``qps x compute_ms(rows) / 1000`` slots (a request's
   own rows; batching across requests is a bonus, not planned on). Beyond ``headroom x capacity`` of
   one site it is copied to the next sites that meet the same SLOs, up to ``max_replicas_per_variant``
   copies.
3. *Evict.* A placed variant no demand needs is evicted once unused for ``idle_evict_s``, never
   before ``min_residency_s`` after it was loaded, never while its heartbeat shows a queue for it,
   never when it is pinned (e.g. the warm floor).

Cascades (issue 33): a demand a calibrated cascade of its task can meet (the cascade's measured accuracy >= the
floor, stage 1 + path + last stage within the budget, from the demand's site) keeps that cascade placed besides
its plain cover, so routing can choose it: stage 1 as near the demand as it fits (its own edge first), the last
stage where one is placed (else loaded where the escalated path fits), assigned the escalation share of the
demand for replication. Middle stages of a cascade of more than two are not placed here (routing then finds them
only where something else placed them).

Forecasts: ``Demand.forecast_qps`` (see ``forecast.with_forecast``) raises a demand to
``max(qps, forecast_qps)``; a load that only the forecast needs is a ``prewarm`` event, its
reason naming the forecast (``Demand.forecast_why``). A variant a forecast still needs is kept (it is
"needed"); once neither current nor forecast demand needs it, step 3 evicts it, so between
recurring peaks an edge really drops what the peak used and the next peak is prewarmed again.

Time: ``last_used`` and ``loaded_since`` are seconds on the caller's clock, as ``now``. A pair with
no ``loaded_since`` counts as loaded at ``now`` (the caller has just seen it: keep it a while).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from core_scheduler.policy.snapshot import MeshSnapshot, SiteInfo, VariantInfo

__all__ = ["Action", "Demand", "PlacementConfig", "PlacementEvent", "PlacementPlan", "plan_placement"]

Action = Literal["load", "evict", "keep", "prewarm"]
_PRECISION_RANK = {"int8": 0, "fp16": 1, "fp32": 2}


@dataclass(frozen=True, slots=True)
class Demand:
    site: str                 # where the traffic enters (an edge, usually)
    task: str
    slo_class: str
    qps: float                # observed
    min_accuracy: float
    budget_ms: float
    tenant: str = "public"    # private variants only serve their owner's demand
    forecast_qps: float = 0.0  # predicted for the planning horizon; 0 = none
    forecast_why: str = ""     # which forecast gave forecast_qps (named in prewarm reasons)
    rows: int = 1              # the most rows one request brings (its compute is that batch's)

    @property
    def effective_qps(self) -> float:
        return max(self.qps, self.forecast_qps)


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    min_residency_s: float = 30.0
    idle_evict_s: float = 120.0
    headroom: float = 0.8     # fraction of a site's memory and slots placement may plan on
    edge_prefer_small: bool = True
    max_replicas_per_variant: int = 8


@dataclass(frozen=True, slots=True)
class PlacementEvent:
    site: str
    variant_id: str
    action: Action
    reason: str


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    per_site: dict[str, tuple[str, ...]]
    events: tuple[PlacementEvent, ...]

    def changes(self) -> tuple[PlacementEvent, ...]:
        """Only the loads, prewarms and evictions (what agents must act on)."""
        return tuple(e for e in self.events if e.action != "keep")


Pair = tuple[str, str]


class _Planner:
    def __init__(self, snap: MeshSnapshot, now: float, last_used: Mapping[Pair, float],
                 loaded_since: Mapping[Pair, float], cfg: PlacementConfig,
                 pinned: Mapping[str, Iterable[str]]) -> None:
        self.snap, self.now, self.cfg = snap, now, cfg
        self.last_used, self.loaded_since = last_used, loaded_since
        self.alive = [s for s in sorted(snap.sites) if snap.is_alive(s)]
        # a variant taken out of the catalog leaves every plan at once (the last placement still names it)
        self.plan: dict[str, set[str]] = {s: {v for v in snap.placed(s) if v in snap.variant_by_id}
                                          for s in sorted(snap.sites)}
        self.pinned = {(s, v) for s, vs in pinned.items() for v in vs}
        self.needed: set[Pair] = set()
        self.events: list[PlacementEvent] = []

    # -- facts ---------------------------------------------------------------------------
    def variant(self, vid: str) -> VariantInfo | None:
        return self.snap.variant_by_id.get(vid)

    def mem_used(self, site: str) -> int:
        """A shared backbone counts once however many heads on it are planned here."""
        vs = [v for vid in self.plan[site] if (v := self.variant(vid)) is not None]
        return sum(v.own_bytes() for v in vs) + sum({v.base: v.base_bytes for v in vs if v.base}.values())

    def mem_need(self, site: str, v: VariantInfo) -> int:
        """What planning ``v`` at ``site`` adds: its backbone only if no head planned there has it."""
        if v.base is not None and any(o is not None and o.base == v.base
                                      for o in (self.variant(x) for x in self.plan[site])):
            return v.own_bytes()
        return v.memory_bytes

    def mem_cap(self, site: str) -> float:
        """On a GPU site the device budget too (``SiteInfo.model_memory_bytes``)."""
        return self.cfg.headroom * self.snap.sites[site].model_memory_bytes

    def slots(self, site: str) -> float:
        load = self.snap.loads.get(site)
        return self.cfg.headroom * (load.capacity if load is not None else self.snap.sites[site].slots)

    def latency(self, d: Demand, site: str, v: VariantInfo) -> float:
        return self.snap.rtt(d.site, site) + v.compute_at(self.snap.sites[site].hardware_class, d.rows)

    def meets(self, d: Demand, site: str, v: VariantInfo) -> bool:
        return (v.task == d.task and v.usable_by(d.tenant) and v.accuracy >= d.min_accuracy
                and self.latency(d, site, v) <= d.budget_ms)

    def idle_s(self, pair: Pair) -> float:
        since = self.loaded_since.get(pair, self.now)
        return self.now - max(self.last_used.get(pair, since), since)

    def resident_s(self, pair: Pair) -> float:
        return self.now - self.loaded_since.get(pair, self.now)

    def in_flight(self, pair: Pair) -> bool:
        load = self.snap.loads.get(pair[0])
        return load is not None and load.queue_ms.get(pair[1], 0.0) > 0.0

    def protected(self, pair: Pair) -> str | None:
        """Why ``pair`` may not be evicted now, or None."""
        if pair in self.needed:
            return "needed by current demand"
        if pair in self.pinned:
            return "pinned"
        if self.in_flight(pair):
            return "has queries in flight"
        if self.resident_s(pair) < self.cfg.min_residency_s:
            return f"loaded {self.resident_s(pair):.0f} s ago, min residency {self.cfg.min_residency_s:.0f} s"
        return None

    # -- actions -------------------------------------------------------------------------
    def emit(self, site: str, vid: str, action: Action, reason: str) -> None:
        self.events.append(PlacementEvent(site, vid, action, reason))

    def make_room(self, site: str, v: VariantInfo) -> list[str] | None:
        """Variants to evict (LRU) so ``v`` fits at ``site``; None when it cannot fit."""
        free = self.mem_cap(site) - self.mem_used(site)
        need = self.mem_need(site, v)
        if need <= free:
            return []
        victims: list[str] = []
        lru = sorted((p for p in ((site, x) for x in self.plan[site]) if self.protected(p) is None),
                     key=lambda p: (-self.idle_s(p), p[1]))
        for pair in lru:
            victims.append(pair[1])
            other = self.variant(pair[1])
            # a victim's own bytes (its backbone stays counted while another head holds it)
            free += other.own_bytes() if other is not None else 0
            if need <= free:
                return victims
        return None

    def try_load(self, site: str, v: VariantInfo, action: Action, reason: str) -> bool:
        victims = self.make_room(site, v)
        if victims is None:
            return False
        for vid in victims:
            self.plan[site].discard(vid)
            self.emit(site, vid, "evict", f"make room for {v.variant_id} (least recently used, idle "
                      f"{self.idle_s((site, vid)):.0f} s)")
        self.plan[site].add(v.variant_id)
        self.needed.add((site, v.variant_id))
        self.emit(site, v.variant_id, action, reason)
        return True

    # -- steps ---------------------------------------------------------------------------
    def site_order(self, d: Demand) -> list[str]:
        """Cheapest slot first (the router bills compute x price per slot, so placing where it is
        cheapest is placing where the router will send the demand), then nearest, then by name.
        ``meets`` leaves only the sites that can serve the demand within its budget."""
        reachable = [s for s in self.alive if math.isfinite(self.snap.rtt(d.site, s))]
        return sorted(reachable, key=lambda s: (self.snap.sites[s].price_per_hour / max(self.snap.sites[s].slots, 1),
                                                self.snap.rtt(d.site, s), s))

    def variant_order(self, site: SiteInfo, vs: list[VariantInfo]) -> list[VariantInfo]:
        hw = site.hardware_class
        if site.tier == "edge" and self.cfg.edge_prefer_small:
            # the file size, not the measured peak: peaks are noisy while other loads run
            return sorted(vs, key=lambda v: (v.size_bytes, _PRECISION_RANK.get(v.precision, 3),
                                             v.compute_at(hw), v.variant_id))
        # elsewhere: cheapest per query (same machine, so least compute), then smaller
        return sorted(vs, key=lambda v: (v.compute_at(hw), v.memory_bytes, v.variant_id))

    def existing(self, d: Demand) -> Pair | None:
        best: tuple[float, str, str] | None = None
        for s in self.alive:
            for vid in sorted(self.plan[s]):
                v = self.variant(vid)
                if v is not None and self.meets(d, s, v):
                    key = (self.latency(d, s, v), s, vid)
                    best = key if best is None or key < best else best
        return None if best is None else (best[1], best[2])

    def cover(self, d: Demand, assigned: dict[Pair, list[Demand]]) -> None:
        pair = self.existing(d)
        what = (f"{d.task}/{d.slo_class} from {d.site}: {d.effective_qps:.1f} qps"
                f"{f' of {d.rows} rows' if d.rows > 1 else ''} within "
                f"{d.budget_ms:.0f} ms at accuracy >= {d.min_accuracy:.3f}")
        action: Action = "load" if d.qps > 0 else "prewarm"
        if pair is None:
            for s in self.site_order(d):
                info = self.snap.sites[s]
                fits = [v for v in self.snap.variants.get(d.task, ()) if self.meets(d, s, v)]
                for v in self.variant_order(info, fits):
                    if self.try_load(s, v, action, f"serve {what}"
                                     + (f" (forecast: {d.forecast_why or 'predicted'})"
                                        if action == "prewarm" else "")):
                        pair = (s, v.variant_id)
                        break
                if pair is not None:
                    break
        if pair is None:
            pair = self.fallback(d, action, what)
        if pair is not None:
            self.needed.add(pair)
            assigned.setdefault(pair, []).append(d)

    def cover_cascades(self, d: Demand, assigned: dict[Pair, list[Demand]]) -> None:
        """Keep placed the first cascade of ``d``'s task that can meet it (module docstring, Cascades)."""
        cascades = self.snap.cascades  # task -> cascade id -> calibrated cascade (core_scheduler.state.snapshot)
        by_id = cascades.get(d.task) or {}
        action: Action = "load" if d.qps > 0 else "prewarm"
        for cid in sorted(by_id):
            c = by_id[cid]
            first, last = self.variant(c.stages[0]), self.variant(c.stages[-1])
            if first is None or last is None or c.owner not in ("public", d.tenant) or c.accuracy < d.min_accuracy:
                continue
            ones = sorted((s for s in self.alive if math.isfinite(self.latency(d, s, first))),
                          key=lambda s: (s != d.site, first.variant_id not in self.plan[s],
                                         self.snap.rtt(d.site, s), s))
            for s1 in ones:
                left = d.budget_ms - self.latency(d, s1, first)
                twos = [s for s in self.site_order(d) if self.latency(d, s, last) <= left]
                twos.sort(key=lambda s: last.variant_id not in self.plan[s])  # stable: placed ones first
                why = f"cascade {cid} for {d.task}/{d.slo_class} from {d.site}"
                s2 = next((s for s in twos if last.variant_id in self.plan[s]
                           or self.try_load(s, last, action, f"last stage of {why}")), None)
                if s2 is None:
                    continue
                if first.variant_id in self.plan[s1] or self.try_load(s1, first, action, f"stage 1 of {why}"):
                    self.needed.update(((s1, first.variant_id), (s2, last.variant_id)))
                    share = c.escalation[-1]
                    assigned.setdefault((s2, last.variant_id), []).append(
                        replace(d, qps=d.qps * share, forecast_qps=d.forecast_qps * share, min_accuracy=0.0))
                    return

    def fallback(self, d: Demand, action: Action, what: str) -> Pair | None:
        """No site meets the SLO: keep (or load) the lowest-latency server of the task."""
        opts: list[tuple[bool, float, str, str]] = []
        for s in self.alive:
            for v in self.snap.variants.get(d.task, ()):
                lat = self.latency(d, s, v)
                if v.usable_by(d.tenant) and math.isfinite(lat):
                    opts.append((v.accuracy < d.min_accuracy, lat, s, v.variant_id))
        placed = sorted(o for o in opts if o[3] in self.plan[o[2]])
        if placed:
            return (placed[0][2], placed[0][3])
        for _, lat, s, vid in sorted(opts):
            v = self.snap.variant_by_id[vid]
            if self.try_load(s, v, action, f"best effort for {what}: nothing meets it, "
                             f"nearest server {lat:.0f} ms"):
                return (s, vid)
        return None

    def replicate(self, pair: Pair, demands: list[Demand]) -> None:
        site, vid = pair
        v = self.snap.variant_by_id[vid]
        cap = self.cfg.max_replicas_per_variant

        rows = max(d.rows for d in demands)

        def copies(qps: float) -> int:
            need = qps * v.compute_at(self.snap.sites[site].hardware_class, rows) / 1000.0
            return min(cap, max(1, math.ceil(need / max(self.slots(site), 1e-9))))

        now_qps = sum(d.qps for d in demands)
        want_now, want = copies(now_qps), copies(sum(d.effective_qps for d in demands))
        if want <= 1:
            return
        ok_sites = [s for s in self.alive if s != site and all(self.meets(d, s, v) for d in demands)]
        ok_sites.sort(key=lambda s: (vid not in self.plan[s],
                                     max(self.snap.rtt(d.site, s) for d in demands), s))
        have = 1
        for s in ok_sites:
            if have >= want:
                break
            if vid in self.plan[s]:
                self.needed.add((s, vid))
                have += 1
                continue
            action: Action = "load" if have < want_now else "prewarm"
            if self.try_load(s, v, action, f"replicate: {max(now_qps, 0):.1f} qps now"
                             f"{'' if action == 'load' else ' (forecast higher)'} needs {want} copies "
                             f"of {vid} (one site holds {self.slots(site):.1f} slots)"):
                have += 1

    def evict_idle(self) -> None:
        for s in self.alive:
            for vid in sorted(self.plan[s]):
                pair = (s, vid)
                idle = self.idle_s(pair)
                if idle < self.cfg.idle_evict_s:
                    continue
                why = self.protected(pair)
                if why is None:
                    self.plan[s].discard(vid)
                    self.emit(s, vid, "evict", f"idle {idle:.0f} s >= {self.cfg.idle_evict_s:.0f} s")
                elif why != "needed by current demand" and why != "pinned":
                    self.emit(s, vid, "keep", f"idle {idle:.0f} s but {why}")


def plan_placement(snap: MeshSnapshot, demand: Iterable[Demand], now: float,
                   last_used: Mapping[Pair, float], loaded_since: Mapping[Pair, float],
                   cfg: PlacementConfig | None = None, *,
                   pinned: Mapping[str, Iterable[str]] | None = None) -> PlacementPlan:
    """Plan the variants per site. ``pinned`` variants (e.g. the warm floor) are never evicted."""
    p = _Planner(snap, now, last_used, loaded_since, cfg or PlacementConfig(), pinned or {})
    merged: dict[tuple[str, str, str, str], Demand] = {}
    for d in demand:
        if d.effective_qps <= 0 or d.site not in snap.site_index or not snap.variants.get(d.task):
            continue
        key = (d.site, d.task, d.slo_class, d.tenant)
        old = merged.get(key)
        merged[key] = d if old is None else Demand(
            d.site, d.task, d.slo_class, old.qps + d.qps, max(old.min_accuracy, d.min_accuracy),
            min(old.budget_ms, d.budget_ms), d.tenant, old.forecast_qps + d.forecast_qps,
            old.forecast_why or d.forecast_why, max(old.rows, d.rows))
    # tightest first: they have the fewest options; what is already placed is claimed before
    # anything is evicted to make room
    order = sorted(merged.values(), key=lambda d: (d.budget_ms, -d.min_accuracy, d.site, d.task,
                                                    d.slo_class, d.tenant))
    for d in order:
        pair = p.existing(d)
        if pair is not None:
            p.needed.add(pair)
    assigned: dict[Pair, list[Demand]] = {}
    for d in order:
        p.cover(d, assigned)
        p.cover_cascades(d, assigned)
    for pair in sorted(assigned):
        p.replicate(pair, assigned[pair])
    p.evict_idle()
    per_site = {s: tuple(sorted(vs)) for s, vs in p.plan.items()}
    return PlacementPlan(per_site=per_site, events=tuple(p.events))
