"""``control_plane``: what the control plane costs etcd and each agent at 10, 100 and 1,000 sites.

Per mesh size, on a fresh real etcd (``EmbeddedEtcd``), with a synthetic topology (regions of one
middle and nine edges, a core per hundred sites) and a small catalog:

* every site runs the real :class:`edge_agent.liveness.Liveness` (its own lease, keep-alives, the real
  publishing rule) over a record whose load moves like a lightly loaded site's (queue waits drift; now
  and then a wait jumps, which is news);
* ``OBSERVED`` sites also run the real :class:`MeshView` and rebuild a snapshot on every change, timed;
  the per-agent numbers are theirs. (Running a view per site would only multiply identical views: what
  one agent receives does not depend on how many others watch.)

Two modes, measured in the same run one after the other on the same etcd and topology:

* ``before``: what agents did until now: write the full record every beat, follow the whole prefix,
  rebuild the snapshot from scratch (``build_snapshot``) on every change;
* ``after``: write when the record has news (``why_publish``), follow the route set only (``Scope``),
  rebuild incrementally (``SnapshotBuilder``).

Per-agent etcd traffic = the writes a site makes plus the watch events its view receives, per second,
in messages and bytes. Then a scheduler (the real one) places at every site: placement succeeds when
every ``placement/<site>`` key exists (the writes are chunked within etcd's 128-operation txns).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import Panel, RunContext, percentile, plot_panels, ratio, target, write_result
from core_scheduler.scheduler import Scheduler, SchedulerConfig
from core_scheduler.state.heartbeat import Heartbeat, LoadedVariant, PublishPolicy
from core_scheduler.state.scope import Scope
from core_scheduler.state.snapshot import SnapshotBuilder, build_snapshot
from core_scheduler.state.view import MeshView
from edge_agent.liveness import Liveness
from mesh.etcd.keys import PLACEMENT, catalog_key
from mesh.etcd.ops import Put, chunk_ops
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from topology.schema import Hardware, Link, Site, Topology
from topology.store_io import _meta, desired_state
from variant_store.meta import LatencyStats, Profile, VariantMeta

__all__ = ["OBSERVED", "SIZES", "run_control_plane", "synthetic_topology"]

SIZES = (10, 100, 1000)
OBSERVED = 8          # sites per size whose view and snapshot rebuilds are measured
HEARTBEAT_S = 1.0     # the agent defaults
TTL_S = 3.0
JUMP_P = 0.03         # chance per beat that a site's queue wait jumps (news worth publishing)
STORES = 8            # gRPC connections the simulated sites share


def synthetic_topology(n: int) -> Topology:
    """``n`` sites: cores ``c00..`` (one per hundred sites, in a ring), regions ``r000..`` of a middle and
    up to nine edges; edges 2 ms from their middle, middles 5 ms from the next region's and 15 ms from a core."""
    cores = max(1, n // 100)
    names_core = [f"c{i:02d}" for i in range(cores)]
    sites: dict[str, Site] = {}
    links: list[Link] = []
    hw_core = Hardware(cpu_cores=16, memory_mb=65536, price_per_hour=2.0)
    hw_mid = Hardware(cpu_cores=8, memory_mb=16384, price_per_hour=0.8)
    hw_edge = Hardware(cpu_cores=4, memory_mb=8192, price_per_hour=0.3)
    for i, c in enumerate(names_core):
        sites[c] = Site(c, "core", "core", 0.0, float(i), hw_core)
        if cores > 1:
            links.append(Link(c, names_core[(i + 1) % cores], 20.0, 10000.0))
    left = n - cores
    regions = (left + 9) // 10
    middles = []
    for r in range(regions):
        size = min(10, left - 10 * r)
        mid = f"r{r:03d}-m"
        middles.append(mid)
        sites[mid] = Site(mid, "middle", f"r{r:03d}", 1.0, float(r), hw_mid)
        links.append(Link(mid, names_core[r % cores], 15.0, 1000.0))
        for e in range(size - 1):
            edge = f"r{r:03d}-e{e}"
            sites[edge] = Site(edge, "edge", f"r{r:03d}", 2.0, float(r), hw_edge)
            links.append(Link(edge, mid, 2.0, 100.0))
    for a, b in itertools.pairwise(middles):
        links.append(Link(a, b, 5.0, 1000.0))
    uniq = {(lk.a, lk.b): lk for lk in links if lk.a != lk.b}
    return Topology(sites=sites, links=tuple(sorted(uniq.values(), key=lambda lk: (lk.a, lk.b))))


def _variants() -> list[VariantMeta]:
    out = []
    for fam, acc, ms, size in (("tiny", 0.96, 0.3, 1 << 20), ("small", 0.98, 1.0, 4 << 20),
                               ("large", 0.987, 3.0, 16 << 20)):
        prof = Profile(hardware_class="cpu", load_ms=50.0 * ms, peak_memory_bytes=size,
                       latency={1: LatencyStats(ms, ms * 2), 8: LatencyStats(ms * 3, ms * 6)})
        out.append(VariantMeta(task="digits", family=fam, variant_id=f"{fam}.fp32", format="onnx",
                               precision="fp32", runtime="onnxruntime", blob_digest="ab" * 32, size_bytes=size,
                               accuracy=acc, batch_sizes=[1, 8], profiles={"cpu": prof}))
    return out


async def _seed(store: Store, topo: Topology) -> None:
    """The topology and catalog, written in txns of etcd's size (``topology apply`` takes one txn)."""
    ops = [Put(k, v) for k, v in desired_state(topo).items()]
    ops += [Put(catalog_key(m.task, m.variant_id), m.to_json()) for m in _variants()]
    ops.append(Put("topology/meta", _meta(topo)))
    for part in chunk_ops(ops):
        await store.txn([], part)


@dataclass
class SiteLoop:
    """One simulated site: a live record whose queue waits drift, and its Liveness."""

    name: str
    rng: random.Random
    queue: dict[str, float] = field(default_factory=lambda: {"tiny.fp32": 1.0})
    liveness: Liveness | None = None

    def record(self) -> Heartbeat:
        for vid, q in self.queue.items():
            if self.rng.random() < JUMP_P:
                self.queue[vid] = 1.0 if q > 5 else 12.0            # a burst starts or ends: news
            else:
                self.queue[vid] = max(0.0, q + self.rng.uniform(-0.2, 0.2))  # drift within noise
        loaded = {vid: LoadedVariant(task="digits", queue_ms=round(q, 3), ewma_compute_ms=0.3, served=0)
                  for vid, q in self.queue.items()}
        return Heartbeat(site=self.name, ts=time.time(), tier="edge", hardware_class="cpu",
                         declared_hardware_class="cpu", endpoint=f"tcp://127.0.0.1:{40000 + hash(self.name) % 20000}",
                         http="http://127.0.0.1:1", loaded=loaded, capacity=16,
                         memory_total_bytes=8 << 30, model_memory_budget_bytes=2 << 30,
                         memory_used_bytes=1 << 20)


@dataclass
class Observer:
    """A measured agent: its view and the time of each snapshot rebuild."""

    view: MeshView
    mode: str
    builder: SnapshotBuilder
    rebuild_ms: list[float] = field(default_factory=list)
    path_lookups0: int = 0

    def on_change(self) -> None:
        t0 = time.perf_counter()
        if self.mode == "before":
            build_snapshot(self.view, here=self.view.site)
        else:
            self.builder.build()
        self.rebuild_ms.append((time.perf_counter() - t0) * 1000.0)


async def _measure(stores: list[Store], topo: Topology, mode: str, seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    names = sorted(topo.sites)
    before = mode == "before"
    # before: a write every beat (nothing is ever "not news"); after: the publishing rule
    policy = PublishPolicy(usage_interval_s=0.0, max_interval_s=0.0, queue_abs_ms=-1.0, queue_rel=-1.0) \
        if before else PublishPolicy()
    loops = [SiteLoop(n, random.Random(rng.random())) for n in names]
    # before at 1,000 sites: every whole-prefix view parses every record written; two are all this
    # process can carry beside the writers (and it still falls behind: see the writes/s it reached)
    k = OBSERVED if not (before and len(names) > 100) else 2
    watched = sorted(rng.sample([n for n in names if topo.sites[n].tier == "edge"] or names, min(k, len(names))))
    observers: list[Observer] = []
    try:
        for i, loop in enumerate(loops):
            loop.liveness = Liveness(stores[i % len(stores)], loop.name, loop.record, ttl_s=TTL_S,
                                     interval_s=HEARTBEAT_S, policy=policy)
        # start in waves: a thousand lease grants at once would time out on a 2-core box
        t_start = time.monotonic()
        for i in range(0, len(loops), 100):
            await asyncio.gather(*(lp.liveness.start() for lp in loops[i:i + 100] if lp.liveness))
        print(f"   [{mode}] {len(loops)} sites live in {time.monotonic() - t_start:.1f} s", flush=True)
        for i, name in enumerate(watched):
            view = MeshView(stores[i % len(stores)], name, debounce_s=0.2,
                            scope=None if before else Scope(name))
            await view.start()
            obs = Observer(view, mode, SnapshotBuilder(view, here=name))
            obs.on_change()  # the first (full) build, not counted
            obs.rebuild_ms.clear()
            view.on_change(obs.on_change)
            observers.append(obs)
        print(f"   [{mode}] {len(observers)} views up in {time.monotonic() - t_start:.1f} s", flush=True)
        await asyncio.sleep(2.0)  # settle: first records, watches established
        w0 = [(lp.liveness.writes, lp.liveness.bytes_written) for lp in loops if lp.liveness]
        e0 = [(o.view.events, o.view.event_bytes) for o in observers]
        for o in observers:
            o.rebuild_ms.clear()
            o.path_lookups0 = o.builder.path_lookups
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        dt = time.monotonic() - t0
        writes = [(lp.liveness.writes - a, lp.liveness.bytes_written - b)
                  for lp, (a, b) in zip(loops, w0, strict=True) if lp.liveness]
        events = [(o.view.events - a, o.view.event_bytes - b) for o, (a, b) in zip(observers, e0, strict=True)]
        rebuilds = [x for o in observers for x in o.rebuild_ms]
        ranges = statistics.mean(len(o.view.ranges) for o in observers)
        followed = statistics.mean(len(o.view.live) for o in observers)
        path_lookups = sum(o.builder.path_lookups - o.path_lookups0 for o in observers) if not before else None
    finally:
        for o in observers:
            await o.view.stop()
        for i in range(0, len(loops), 100):
            await asyncio.gather(*(lp.liveness.stop() for lp in loops[i:i + 100] if lp.liveness),
                                 return_exceptions=True)
    n = len(loops)
    w_rate = sum(w for w, _ in writes) / dt
    w_bytes = sum(b for _, b in writes) / dt
    ev_rate = statistics.mean(e for e, _ in events) / dt
    ev_bytes = statistics.mean(b for _, b in events) / dt
    return {"sites": n, "mode": mode, "seconds": round(dt, 1), "observed_agents": len(events),
            "saturated": before and w_rate < 0.9 * n / HEARTBEAT_S,
            "etcd_writes_per_s": round(w_rate, 1), "etcd_write_bytes_per_s": round(w_bytes),
            "writes_per_s_per_agent": round(w_rate / n, 3), "write_bytes_per_s_per_agent": round(w_bytes / n, 1),
            "watch_events_per_s_per_agent": round(ev_rate, 2), "watch_bytes_per_s_per_agent": round(ev_bytes),
            "agent_msgs_per_s": round(w_rate / n + ev_rate, 2),
            "agent_bytes_per_s": round(w_bytes / n + ev_bytes),
            "live_records_followed": round(followed, 1), "watch_ranges": round(ranges, 1),
            "rebuilds": len(rebuilds), "rebuild_median_ms": round(percentile(rebuilds, 50), 3),
            "rebuild_p99_ms": round(percentile(rebuilds, 99), 3), "path_table_lookups": path_lookups}


async def _placement(store: Store, topo: Topology) -> dict[str, Any]:
    """A real scheduler over live records of every site: does every placement key get written?"""
    lease = await store.lease(30)
    for part in chunk_ops([Put(f"live/{n}", SiteLoop(n, random.Random(1)).record().to_json(), lease)
                           for n in sorted(topo.sites)]):
        await store.txn([], part)
    sched = Scheduler(store, SchedulerConfig(candidate_id="bench", interval_s=1.0, proactive=True))
    t0 = time.monotonic()
    placed = 0
    try:
        await sched.start()
        deadline = t0 + 60.0
        while time.monotonic() < deadline:
            placed = len(await store.get_prefix(PLACEMENT))
            if placed >= len(topo.sites):
                break
            await asyncio.sleep(0.5)
        took = time.monotonic() - t0
        saved = await sched.save_forecast() if sched.is_leader else False
    finally:
        await sched.stop()
        await lease.revoke()
    return {"sites": len(topo.sites), "placed_sites": placed, "placement_ok": placed >= len(topo.sites),
            "seconds_to_place": round(took, 1), "refused": sched.refused, "forecast_saved": bool(saved)}


async def _one_size(n: int, seconds: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    topo = synthetic_topology(n)
    with tempfile.TemporaryDirectory(prefix="tm-cp-") as tmp:
        etcd = EmbeddedEtcd(Path(tmp) / "etcd", unsafe_no_fsync=True)
        await etcd.start()
        stores: list[Store] = []
        try:
            stores = [await Store.connect(etcd.url, "/bench/", timeout=15.0) for _ in range(STORES)]
            await _seed(stores[0], topo)
            # after first: a saturated "before" at 1,000 sites must not disturb it
            rows = [await _measure(stores, topo, mode, seconds, seed=n) for mode in ("after", "before")][::-1]
            place = await _placement(stores[0], topo)
        finally:
            for s in stores:
                with contextlib.suppress(Exception):
                    await s.close()
            await etcd.stop()
    return rows, place


async def run_control_plane(ctx: RunContext) -> Path:
    seconds = float(ctx.pick(8, 20))
    rows: list[dict[str, Any]] = []
    places: list[dict[str, Any]] = []
    for n in SIZES:
        r, p = await _one_size(n, seconds)
        rows += r
        places.append(p)
        print(f"   {n} sites: " + "; ".join(f"{x['mode']}: {x['agent_msgs_per_s']} msg/s, "
                                             f"{x['agent_bytes_per_s']} B/s per agent, rebuild "
                                             f"{x['rebuild_median_ms']} ms" for x in r)
              + f"; placement {'ok' if p['placement_ok'] else 'FAILED'}", flush=True)
    after = {r["sites"]: r for r in rows if r["mode"] == "after"}
    targets = [
        target("per-agent etcd messages/s, 1,000 vs 100 sites", ratio(after[1000]["agent_msgs_per_s"],
                                                                      after[100]["agent_msgs_per_s"]), 1.2, unit="x"),
        target("per-agent etcd bytes/s, 1,000 vs 100 sites", ratio(after[1000]["agent_bytes_per_s"],
                                                                   after[100]["agent_bytes_per_s"]), 1.2, unit="x"),
        target("snapshot rebuild on a heartbeat at 1,000 sites (median)", after[1000]["rebuild_median_ms"], 1.0,
               unit="ms"),
        target("placement written at every site of 1,000", float(places[-1]["placed_sites"]), 1000.0, op=">=",
               unit="sites"),
    ]
    groups = [str(n) for n in SIZES]

    def series(key: str) -> dict[str, list[float]]:
        return {mode: [float(next(r[key] for r in rows if r["sites"] == n and r["mode"] == mode)) for n in SIZES]
                for mode in ("before", "after")}

    plot_panels(ctx.results_dir / "control_plane.png", "Control plane cost per agent vs mesh size", [
        Panel("etcd messages per agent (writes + watch events)", "per s (log)", groups,
              series("agent_msgs_per_s"), log_y=True),
        Panel("etcd bytes per agent", "B/s (log)", groups, series("agent_bytes_per_s"), log_y=True),
        Panel("snapshot rebuild on a change (median)", "ms (log)", groups, series("rebuild_median_ms"),
              log_y=True)])
    return write_result(ctx, "control_plane", rows, targets, extra={"placement": places}, notes=(
        f"Real etcd per size; every site runs the real Liveness (lease, keep-alives, publishing rule) in one "
        f"process over {STORES} shared gRPC connections; {OBSERVED} edge sites per size also run the real "
        f"MeshView and rebuild a snapshot on every change (the per-agent watch numbers and rebuild times are "
        f"theirs). Records drift within noise every beat ({HEARTBEAT_S:g} s) and jump with p={JUMP_P} per beat. "
        "before = full record every beat, whole-prefix watch, build_snapshot from scratch; after = why_publish, "
        "route-set scope (48 nearest + 2 per tier), SnapshotBuilder. Keep-alives (one per lease per TTL/3) "
        "are not counted in messages. Topology and catalog are written in chunked txns (topology apply is one "
        "txn, refused past 128 keys). saturated = the before mode could not keep up its own write rate in one "
        "process (its leases then lapse): its numbers at that size are a floor on what it would cost."))


if __name__ == "__main__":
    from bench.common import run_standalone

    run_standalone("control_plane", quick=False, scenario=run_control_plane)
