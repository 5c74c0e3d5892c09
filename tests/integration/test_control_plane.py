"""A control plane that grows linearly, on a real etcd: an agent's view follows only what it routes on,
a quiet site stays alive on keep-alives and a dead one vanishes within its TTL, placement past etcd's
128-operation txn limit is written in fenced chunks, the forecast survives a leader failover, and demand of
many-row requests reaches placement with its rows."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from core_scheduler.policy.placement import Demand
from core_scheduler.scheduler import Scheduler, SchedulerConfig
from core_scheduler.state.heartbeat import DemandSample, Heartbeat
from core_scheduler.state.scope import Scope
from core_scheduler.state.view import MeshView
from edge_agent.liveness import Liveness
from mesh.errors import StoreError
from mesh.etcd.keys import EVENTS_PLACEMENT, PLACEMENT, catalog_key, live_key, placement_key
from mesh.etcd.ops import Put, chunk_ops
from mesh.etcd.store import Store
from mesh.etcd.watch import KeyRange
from tests.helpers.waiting import eventually
from topology.schema import Hardware, Link, Site, Topology
from topology.store_io import desired_state
from variant_store.meta import LatencyStats, Profile, VariantMeta

pytestmark = pytest.mark.integration


def _topology(n_edges: int) -> Topology:
    """A core ``c`` and a line of edges ``e000..``, each 1 ms further out."""
    hw = Hardware(cpu_cores=4, memory_mb=8192, price_per_hour=0.3)
    sites = {"c": Site("c", "core", "r", 0.0, 0.0, Hardware(cpu_cores=16, memory_mb=65536, price_per_hour=2.0))}
    sites.update({f"e{i:03d}": Site(f"e{i:03d}", "edge", "r", 0.0, 0.0, hw) for i in range(n_edges)})
    links = [Link("c", "e000", 1.0, 100.0)] + [Link(f"e{i:03d}", f"e{i + 1:03d}", 1.0, 100.0)
                                               for i in range(n_edges - 1)]
    return Topology(sites=sites, links=tuple(links))


def _meta(variant_id: str = "t.v1", *, digest: str = "ab", size: int = 1 << 20, accuracy: float = 0.97,
          profiles: dict[str, Profile] | None = None) -> VariantMeta:
    """A variant of task ``t`` (by default one profiled on class ``cpu`` at 1 ms a row)."""
    if profiles is None:
        profiles = {"cpu": Profile(hardware_class="cpu", load_ms=5.0, latency={1: LatencyStats(1.0, 2.0)},
                                   peak_memory_bytes=1 << 20)}
    return VariantMeta(task="t", family="f", variant_id=variant_id, format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest=digest * 32, size_bytes=size, accuracy=accuracy,
                       profiles=profiles)


async def _seed(store: Store, topo: Topology) -> None:
    ops = [Put(k, v) for k, v in desired_state(topo).items()] + [Put(catalog_key("t", "t.v1"), _meta().to_json())]
    for part in chunk_ops(ops):
        await store.txn([], part)


def _record(site: str, **kw: Any) -> dict[str, Any]:
    return Heartbeat(site=site, hardware_class="cpu", capacity=8, model_memory_budget_bytes=1 << 30, **kw).to_json()


async def test_watch_ranges_deliver_only_their_keys(store: Store) -> None:
    async with store.watch_ranges([KeyRange.key("live/b"), KeyRange("live/d", "live/f")]) as w:
        for k in ("live/a", "live/b", "live/c", "live/d", "live/e", "live/f"):
            await store.put(k, {"k": k})
        got = [(await asyncio.wait_for(w.__anext__(), 5.0)).key for _ in range(3)]
    assert sorted(got) == ["live/b", "live/d", "live/e"]


async def test_an_agent_view_ignores_keys_it_does_not_route_on(store: Store) -> None:
    topo = _topology(60)
    await _seed(store, topo)
    view = MeshView(store, "e000", debounce_s=0.05, scope=Scope("e000", peers=5, per_tier=1))
    await view.start()
    try:
        assert view.loaded.is_set() and len(view.ranges) < 10
        base = view.events
        lease = await store.lease(10)
        for site in ("e003", "e050", "e059"):  # one near, two far
            await store.put(live_key(site), _record(site), lease=lease)
        await store.put(placement_key("e050"), {"variants": []})
        await store.put(placement_key("e000"), {"variants": [{"task": "t", "variant_id": "t.v1"}]})
        await eventually(lambda: _ready(view), 10, "the near heartbeat and our own placement in the view")
        await asyncio.sleep(0.5)  # anything else would have arrived by now
        assert set(view.live) == {"e003"} and set(view.placement) == {"e000"}
        assert view.events - base == 2, "events about keys this agent does not route on reached it"
        # a topology change that moves e050 next to us: the view follows it from then on
        moved = Topology(sites=topo.sites, links=(*topo.links, Link("e000", "e050", 0.5, 100.0)))
        await _seed(store, moved)
        await eventually(lambda: _has(view, "e050"), 10, "the moved site's heartbeat in the view")
        assert "e059" not in view.live
    finally:
        await view.stop()


async def test_a_view_tells_its_listeners_which_kinds_of_keys_changed(store: Store) -> None:
    """What a notification covered (``MeshView.changes``): ``all`` after the first read, ``live`` alone when only
    heartbeats changed (an agent paces its routing table on those: edge_agent.table_pacer), the placement's kind
    when placement changed too."""
    await _seed(store, _topology(4))
    view = MeshView(store, "e000", debounce_s=0.05)
    seen: list[frozenset[str]] = []
    view.on_change(lambda: seen.append(view.changes))
    await view.start()
    try:
        await eventually(_now(lambda: bool(seen)), 10, "the first notification")
        assert "all" in seen[0]
        lease = await store.lease(10)
        await store.put(live_key("e001"), _record("e001"), lease=lease)
        await eventually(_now(lambda: "e001" in view.live), 10, "the heartbeat in the view")
        await asyncio.sleep(0.3)
        assert seen[-1] == frozenset({"live"}), seen
        await store.put(placement_key("e000"), {"variants": [{"task": "t", "variant_id": "t.v1"}]})
        await eventually(_now(lambda: "e000" in view.placement), 10, "our placement in the view")
        await asyncio.sleep(0.3)
        assert "placement" in seen[-1], seen
    finally:
        await view.stop()


def _now(fn: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return fn()
    return check


async def _ready(view: MeshView) -> bool:
    return "e003" in view.live and "e000" in view.placement


async def _has(view: MeshView, site: str) -> bool:
    return site in view.live


async def test_quiet_site_stays_alive_and_a_dead_one_vanishes_within_its_ttl(store: Store) -> None:
    ttl = 2.0
    rec = Heartbeat(site="e1", endpoint="tcp://x:1", capacity=4)
    alive = Liveness(store, "e1", lambda: rec, ttl_s=ttl, interval_s=0.2)
    await alive.start()
    try:
        await asyncio.sleep(3 * ttl)
        assert await store.get(live_key("e1")) is not None, "a quiet site's record expired"
        assert alive.writes == 1 and alive.skipped > 10  # kept by keep-alives, not rewrites
        # the process dies: no more keep-alives, nothing revoked
        assert alive._task is not None and alive.lease is not None
        alive._task.cancel()
        alive.lease._task.cancel()  # type: ignore[union-attr]
        died = time.monotonic()
        await eventually(lambda: _gone(store, "e1"), ttl + 4.0, "the dead site's record gone")
        assert time.monotonic() - died <= ttl + 4.0
    finally:
        with contextlib.suppress(StoreError, TimeoutError):  # its lease may be gone in etcd already
            await alive.stop()


async def _gone(store: Store, site: str) -> bool:
    return await store.get(live_key(site)) is None


async def test_placement_past_128_sites_is_written_in_fenced_chunks(store: Store) -> None:
    topo = _topology(199)  # 200 sites: 200 placement keys plus the events, in one txn etcd would refuse
    await _seed(store, topo)
    lease = await store.lease(30)
    for part in chunk_ops([Put(live_key(s), _record(s), lease) for s in topo.sites]):
        await store.txn([], part)
    sched = Scheduler(store, SchedulerConfig(candidate_id="a", interval_s=0.5, proactive=False))
    await sched.start()
    try:
        placed = await eventually(lambda: _placed(store, 200), 30, "a placement for every one of 200 sites")
        assert len(placed) == 200 and sched.refused == 0 and sched.writes >= 1
        p = (await store.get(placement_key("e150")))
        assert p is not None and p.value["leader"] == "a" and p.value["variants"]
    finally:
        await sched.stop()


async def _placed(store: Store, n: int) -> list[Any] | None:
    items = await store.get_prefix(PLACEMENT)
    return items if len(items) >= n else None


async def test_forecast_state_survives_a_leader_failover(store: Store) -> None:
    topo = _topology(3)
    await _seed(store, topo)
    lease = await store.lease(30)
    demand = (DemandSample("t", "fast", "public", 6.0, 20.0, 0.9),)
    for s in topo.sites:
        await store.put(live_key(s), _record(s, demand=demand if s == "e002" else ()), lease=lease)
    cfg = {"interval_s": 0.3, "election_ttl_s": 2.0, "forecast_persist_s": 0.5, "forecast_period_s": 3600.0,
           "forecast_bin_s": 60.0}
    a = Scheduler(store, SchedulerConfig(candidate_id="a", **cfg))
    b = Scheduler(store, SchedulerConfig(candidate_id="b", **cfg))
    await a.start()
    try:
        await eventually(lambda: _saved(a), 20, "the leader saved its forecast state")
        level = a.forecaster.state("e002", "t", "fast", "public")
        assert level is not None and level.n >= 2
        await b.start()
        await a.stop()  # resigns: b leads
        await eventually(lambda: _leads(b), 20, "the second replica leads")
        got = b.forecaster.state("e002", "t", "fast", "public")
        assert b.forecast_restored == 1 and got is not None and got.n >= level.n
        assert got.level == pytest.approx(6.0, rel=0.05)
        assert b.forecaster.seasonal("e002", "t", "fast", "public") is not None
        f = b.forecaster.forecast(10.0)
        assert f and isinstance(f[0], Demand) and f[0].site == "e002"
    finally:
        await a.stop()
        await b.stop()


async def _saved(s: Scheduler) -> bool:
    return s.forecast_saves >= 2


async def _leads(s: Scheduler) -> bool:
    return s.is_leader and s.rounds >= 1


def _profiles(p50: dict[str, dict[int, float]]) -> dict[str, Profile]:
    return {hw: Profile(hardware_class=hw, load_ms=5.0, latency={b: LatencyStats(ms, ms) for b, ms in by.items()},
                        peak_memory_bytes=1 << 20) for hw, by in p50.items()}


async def test_a_demand_of_64_rows_is_placed_where_64_rows_meet_its_slo(store: Store) -> None:
    """An edge's heartbeat reports 64-row requests (rows travel in the record); the leader plans them on the
    GPU core, 2 ms away, the only site that computes 64 rows within the budget: the edge, which answers
    one row in 1 ms, takes 200 ms for 64."""
    topo = _topology(2)
    small = _meta("t.v1", accuracy=0.95,
                  profiles=_profiles({"cpu": {1: 1.0, 64: 200.0}, "gpu": {1: 1.0, 64: 5.0}}))
    big = _meta("t.v2", digest="cd", size=4 << 20,
                profiles=_profiles({"cpu": {1: 2.0, 64: 400.0}, "gpu": {1: 2.0, 64: 400.0}}))
    ops = [Put(k, v) for k, v in desired_state(topo).items()] + [
        Put(catalog_key("t", m.variant_id), m.to_json()) for m in (small, big)]
    await store.txn([], ops)
    lease = await store.lease(30)
    many = (DemandSample("t", "loose-lo-x64", "public", 5.0, 50.0, 0.9, rows=64),)
    await store.put(live_key("c"), Heartbeat(site="c", hardware_class="gpu", capacity=8,
                                             model_memory_budget_bytes=1 << 30).to_json(), lease=lease)
    for s in ("e000", "e001"):
        await store.put(live_key(s), _record(s, demand=many if s == "e000" else ()), lease=lease)
    sched = Scheduler(store, SchedulerConfig(candidate_id="a", interval_s=0.3, proactive=False))
    await sched.start()
    try:
        core = await eventually(lambda: _placed_at(store, "c", "t.v1"), 20, "t.v1 planned on the core")
        assert "t.v2" in core  # the floor's most accurate variant stays; the 64-row demand added t.v1
        assert await _placed_at(store, "e000", "t.v1") == ["t.v1"]  # the floor's; it cannot serve 64 rows
    finally:
        await sched.stop()


async def _placed_at(store: Store, site: str, variant: str) -> list[str] | None:
    kv = await store.get(placement_key(site))
    names = sorted(v["variant_id"] for v in kv.value["variants"]) if kv is not None else []
    return names if variant in names else None


async def test_a_site_taken_out_of_the_topology_is_retired(store: Store) -> None:
    """`topology apply` without a site retires it cleanly: the leader deletes its placement (nothing would ever
    rewrite it) and says so in its events; the other sites keep theirs."""
    from topology.store_io import apply as apply_topology

    topo = _topology(2)
    await _seed(store, topo)
    lease = await store.lease(30)
    for s in topo.sites:
        await store.put(live_key(s), _record(s), lease=lease)
    sched = Scheduler(store, SchedulerConfig(candidate_id="a", interval_s=0.3, proactive=False))
    await sched.start()
    try:
        await eventually(lambda: _placed(store, 3), 20, "a placement for each of the three sites")
        await store.delete(live_key("e001"))  # the machine is gone (revoked: its lease revoked) ...
        smaller = Topology(sites={n: s for n, s in topo.sites.items() if n != "e001"},
                           links=tuple(lk for lk in topo.links if "e001" not in lk.ends))
        await apply_topology(store, smaller)  # ... and the operator takes it out of the topology

        async def retired() -> bool:
            return await store.get(placement_key("e001")) is None

        await eventually(retired, 20, "the retired site's placement deleted")
        assert await store.get(placement_key("e000")) is not None and await store.get(placement_key("c")) is not None
        events = (await store.get(EVENTS_PLACEMENT)).value["events"]  # type: ignore[union-attr]
        assert any(e["site"] == "e001" and e["action"] == "retire" for e in events)
    finally:
        await sched.stop()
