"""The scheduler: one leader among replicas (etcd election) runs the placement control loop.

Each round: snapshot the mesh (topology, catalog, heartbeats with demand), forecast demand, plan
placement with the pure policy (warm floor + demand-driven), and write the changed ``placement/<site>``
keys in txns of at most etcd's 128 operations, each fenced by the leader's election key — a stale
leader (its key gone) can never overwrite a newer placement, and a round that changes a thousand sites
is written in eight txns rather than refused. Every change is logged with its reason and kept as an
event for the console. The forecaster's state is saved to etcd every ``forecast_persist_s`` (fenced too,
:mod:`core_scheduler.state.forecast_store`) and read back by each new leader, so a failover does not
restart the forecast from nothing.
The loop never dies: each round catches, logs and continues; leadership lost means campaign again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core_scheduler.job_rounds import JobRounds
from core_scheduler.metrics import SchedulerMetrics
from core_scheduler.policy.floor import floor_placement
from core_scheduler.policy.forecast import DemandForecaster
from core_scheduler.policy.modes import placer_for
from core_scheduler.policy.placement import Demand, PlacementConfig, plan_placement
from core_scheduler.policy.snapshot import MeshSnapshot
from core_scheduler.state.forecast_store import load_forecast, save_forecast
from core_scheduler.state.snapshot import SnapshotBuilder
from core_scheduler.state.view import MeshView
from mesh.backoff import Backoff
from mesh.errors import StoreError
from mesh.etcd.election import Election
from mesh.etcd.keys import EVENTS_PLACEMENT, placement_key
from mesh.etcd.ops import Compare, CreateRevision, Delete, Put, chunk_ops
from mesh.etcd.store import Store
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["Scheduler", "SchedulerConfig"]

log = get_logger(__name__)
MAX_EVENTS = 200
MIN_BACKOFF_S = 0.2  # between campaigns after a failure; doubled up to MAX_BACKOFF_S, jittered
MAX_BACKOFF_S = 2.0
MIN_ROUND_GAP_S = 0.1  # placement rounds woken early by a change are at least this far apart


@dataclass(slots=True)
class SchedulerConfig:
    candidate_id: str
    election_ttl_s: float = 3.0
    interval_s: float = 1.0
    proactive: bool = True            # forecast demand and prewarm ahead of it
    forecast_horizon_s: float = 10.0  # how far ahead prewarming looks
    # seasonal forecast: demand recurring every period (a day) is prewarmed ahead of its phase;
    # None: trend only. Bins of forecast_bin_s; forecasts below forecast_min_qps count as none
    forecast_period_s: float | None = 86_400.0
    forecast_bin_s: float = 300.0
    forecast_min_qps: float = 0.1    # one query per 10 s demand window
    forecast_persist_s: float = 10.0  # how often the leader saves the forecast state to etcd
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    mode: str = "tiermesh"            # or a baseline's placement (core_scheduler.policy.modes)
    # how long a finished offline job (done, failed, cancelled) keeps its record and data (core_scheduler.job_sweeper)
    job_retention_s: float = 7 * 86_400.0


class Scheduler(Service):
    def __init__(self, store: Store, cfg: SchedulerConfig, *,
                 data_ssl: Callable[[], ssl.SSLContext | None] = lambda: None) -> None:
        """``data_ssl``: the client TLS context the leader's retention sweep reaches the variant store's data area
        with (this scheduler's certificate; None for an ``--insecure`` mesh)."""
        self.store = store
        self.cfg = cfg
        self.view = MeshView(store, f"scheduler:{cfg.candidate_id}")
        self.jobs = JobRounds(store, self.view, cfg.candidate_id, retention_s=cfg.job_retention_s, data_ssl=data_ssl)
        self.snapshots = SnapshotBuilder(self.view)
        self.election: Election | None = None
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0
        self.writes = 0
        self.refused = 0                  # fenced writes etcd refused (we were a stale leader)
        self.terms = 0                    # times this replica became leader
        self.events: list[dict[str, Any]] = []
        self.forecaster = DemandForecaster(period_s=cfg.forecast_period_s, bin_s=cfg.forecast_bin_s,
                                           min_qps=cfg.forecast_min_qps)
        self._last_used: dict[tuple[str, str], float] = {}
        self._loaded_since: dict[tuple[str, str], float] = {}
        self._served: dict[tuple[str, str], int] = {}
        self._saved_at = 0.0              # monotonic time of the last forecast save (0: none this term)
        self.forecast_saves = 0
        self.forecast_restored = 0        # demand keys the last restore took over
        # Prometheus metrics (the console mounts core_scheduler.metrics.metrics_handler(self.metrics.registry))
        self.metrics = SchedulerMetrics()
        self.metrics.state = lambda: (self.is_leader, self.view.connected, self.terms)
        # a round comes early (not before MIN_ROUND_GAP_S) when what placement can use changes: a site
        # comes or goes, or a capped site publishes timings of a variant its class could not run before
        self._wake = asyncio.Event()
        self._usable: frozenset[tuple[str, str, int]] = frozenset()
        self.view.on_change(self._on_view_change)

    def _on_view_change(self) -> None:
        # a site's self-measured timings only grow while it lives: their count says when they change, at a
        # cost per site, not per site and variant, on every debounced batch of heartbeats
        usable = frozenset((site, hb.hardware_class or "", len(hb.profiles)) for site, hb in self.view.live.items())
        if usable != self._usable:
            self._usable = usable
            self._wake.set()

    @property
    def is_leader(self) -> bool:
        return bool(self.election and self.election.is_leader)

    async def _start(self) -> None:
        await self.view.start()
        await self.jobs.start()
        self._task = asyncio.create_task(self._run(), name=f"scheduler:{self.cfg.candidate_id}")

    async def _stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await self.jobs.stop()
        if self.election is not None:
            with contextlib.suppress(Exception):
                await self.election.resign()
        await self.view.stop()

    async def _run(self) -> None:
        # One Election for the life of the replica: it remembers leases it could not revoke while
        # etcd was down and clears them before campaigning again.
        self.election = Election(self.store, "scheduler", self.cfg.candidate_id, self.cfg.election_ttl_s)
        backoff = Backoff(MIN_BACKOFF_S, MAX_BACKOFF_S)
        while True:
            try:
                await self.election.campaign()
                backoff.reset()
                self.terms += 1
                log.info("scheduler %s leads (revision %d)", self.cfg.candidate_id, self.election.leader_revision,
                         extra=kv(event="leader"))
                await self._lead(self.election)
            except asyncio.CancelledError:
                raise
            except StoreError as exc:
                log.warning("campaign failed, retrying: %s", exc, extra=kv(event="campaign_failed"))
            except Exception:
                log.exception("scheduler loop error", extra=kv(event="campaign_failed"))
            finally:
                with contextlib.suppress(Exception):
                    await self.election.resign()
            await asyncio.sleep(backoff.next())

    async def _lead(self, election: Election) -> None:
        """Rounds of placement, each followed by one of job assignment, until leadership is lost (key gone, lease
        lost, or a refused write)."""
        self._saved_at = time.monotonic()
        if self.cfg.proactive:
            await self.restore_forecast()
        while not election.lost.is_set():
            try:
                await self.plan_once()
                if self.cfg.proactive and time.monotonic() - self._saved_at >= self.cfg.forecast_persist_s:
                    await self.save_forecast()
            except StoreError as exc:
                log.warning("placement round failed: %s", exc, extra=kv(event="round_failed"))
            except Exception:
                log.exception("placement round error", extra=kv(event="round_failed"))
            # offline jobs: chunks assigned, deadlines and retention, webhooks (core_scheduler.job_rounds; never raises)
            await self.jobs.round(election)
            await self._pause(election)

    async def _pause(self, election: Election) -> None:
        """``interval_s`` between rounds, cut short (after MIN_ROUND_GAP_S) by a change placement can use."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(MIN_ROUND_GAP_S, self.cfg.interval_s)):
                await election.lost.wait()
        if election.lost.is_set() or self._wake.is_set():  # changed during the round or the gap: go now
            self._wake.clear()
            return
        lost = asyncio.ensure_future(election.lost.wait())
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({lost, woken}, timeout=max(0.0, self.cfg.interval_s - MIN_ROUND_GAP_S),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (lost, woken):
                t.cancel()
            await asyncio.gather(lost, woken, return_exceptions=True)
        self._wake.clear()

    # -- forecast state ----------------------------------------------------------------------
    async def restore_forecast(self) -> int:
        """Take over the forecast state the last leader saved; returns the demand keys taken (0: none)."""
        try:
            state = await load_forecast(self.store)
            if state is None:
                return 0
            self.forecast_restored = self.forecaster.load_state(state)
        except (StoreError, ValueError) as exc:
            log.warning("forecast state not restored: %s", exc, extra=kv(event="forecast_restore_failed"))
            return 0
        log.info("forecast state restored: %d demand keys", self.forecast_restored, extra=kv(event="forecast"))
        return self.forecast_restored

    async def save_forecast(self) -> bool:
        """Save the forecast state, fenced by our election key; False when etcd refused (not leader)."""
        assert self.election is not None and self.election.key is not None
        self._saved_at = time.monotonic()
        gen = f"{self.election.leader_revision}-{self.forecast_saves}"
        fence: list[Compare] = [CreateRevision(self.election.key, "==", self.election.leader_revision)]
        if await save_forecast(self.store, self.forecaster.to_state(), gen, fence) is None:
            log.warning("forecast save refused: no longer leader", extra=kv(event="stale_leader"))
            self.election.lost.set()
            return False
        self.forecast_saves += 1
        return True

    # -- one round -------------------------------------------------------------------------
    def _observe(self, snap: MeshSnapshot, now: float) -> None:
        for site, rec in self.view.live.items():
            for vid, info in rec.loaded.items():
                key = (site, vid)
                self._loaded_since.setdefault(key, now)
                served = info.served
                if served != self._served.get(key):
                    self._served[key] = served
                    self._last_used[key] = now
        for key in list(self._loaded_since):
            beat = self.view.live.get(key[0])
            if beat is None or key[1] not in beat.loaded:
                self._loaded_since.pop(key, None)

    def demands(self) -> list[Demand]:
        """Current demand per (site, task, SLO class) from the agents' heartbeats."""
        out: list[Demand] = []
        for site, rec in sorted(self.view.live.items()):
            out.extend(Demand(site=site, task=d.task, slo_class=d.slo_class, qps=d.qps, min_accuracy=d.min_accuracy,
                              budget_ms=d.budget_ms, tenant=d.tenant, rows=d.rows) for d in rec.demand)
        return out

    def plan(self, snap: MeshSnapshot, now: float) -> tuple[dict[str, tuple[str, ...]], list[dict[str, Any]]]:
        """Warm floor plus demand-driven placement (with forecast when proactive)."""
        floor = floor_placement(snap)
        current = self.demands()
        demand = current
        if self.cfg.proactive:
            # wall clock: a seasonal phase is a time of day, and it must mean the same to the next leader
            wall = time.time()
            self.forecaster.observe(current, wall)
            demand = self.forecaster.with_forecast(current, self.cfg.forecast_horizon_s, wall)
        plan = plan_placement(snap, demand, now, self._last_used, self._loaded_since, self.cfg.placement,
                              pinned=floor)
        per_site = {s: set(vs) for s, vs in plan.per_site.items()}
        for s, vs in floor.items():
            per_site.setdefault(s, set()).update(vs)
        events = [{"site": e.site, "variant_id": e.variant_id, "action": e.action, "reason": e.reason}
                  for e in plan.events if e.action != "keep"]
        planned = {s: tuple(sorted(v)) for s, v in per_site.items()}
        placer = placer_for(self.cfg.mode)
        if placer is not None:
            planned = placer(snap, floor, planned, demand)
            events = [{"site": "*", "variant_id": "*", "action": "mode", "reason": f"{self.cfg.mode} placement"}]
        return planned, events

    async def plan_once(self) -> int:
        """One placement round; returns how many placement keys changed."""
        assert self.election is not None
        self.rounds += 1
        self.metrics.rounds.inc()
        started = time.perf_counter()
        snap = self.snapshots.build()
        if snap is None:
            return 0
        now = time.monotonic()
        self._observe(snap, now)
        per_site, events = self.plan(snap, now)
        self.metrics.duration.observe(time.perf_counter() - started)
        ops: list[Any] = []
        changed: list[str] = []
        for site, planned in sorted(per_site.items()):
            vids = tuple(v for v in planned if v in snap.variant_by_id)  # a placer's stale id never ends the round
            variants = [{"task": snap.variant_by_id[v].task, "variant_id": v} for v in vids]
            current = self.view.placement.get(site) or {}
            if current.get("variants") == variants:
                continue
            value = {"schema": 1, "site": site, "variants": variants, "leader": self.cfg.candidate_id,
                     "leader_revision": self.election.leader_revision, "snapshot_revision": snap.version,
                     "ts": time.time()}
            ops.append(Put(placement_key(site), value))
            changed.append(site)
            before = {v["variant_id"] for v in current.get("variants", [])}
            explained = {(e["site"], e["variant_id"]) for e in events}
            for vid in sorted(set(vids) - before):
                if (site, vid) not in explained:
                    events.append({"site": site, "variant_id": vid, "action": "load", "reason": "warm floor"})
            for vid in sorted(before - set(vids)):
                if (site, vid) not in explained:
                    why = "not planned" if vid in snap.variant_by_id else "not in the catalog"
                    events.append({"site": site, "variant_id": vid, "action": "evict", "reason": why})
        # a site taken out of the topology is retired: its placement goes (nothing would ever rewrite it)
        topo = self.view.topology
        for site in sorted(set(self.view.placement) - set(topo.sites if topo is not None else self.view.placement)):
            ops.append(Delete(placement_key(site)))
            changed.append(site)
            events.append({"site": site, "variant_id": "*", "action": "retire", "reason": "left the topology"})
        if not ops:
            return 0
        assert self.election.key is not None
        stamped = [{**e, "ts": time.time(), "leader": self.cfg.candidate_id} for e in events]
        self.events = (self.events + stamped)[-MAX_EVENTS:]
        ops.append(Put(EVENTS_PLACEMENT, {"schema": 1, "events": self.events}))
        # fenced: only while our election key still exists with the revision we won it at; each txn
        # within etcd's operation limit, the events last (a refused chunk ends the round: what was
        # written before it was written by the leader)
        fence: list[Compare] = [CreateRevision(self.election.key, "==", self.election.leader_revision)]
        for part in chunk_ops(ops):
            res = await self.store.txn(fence, part)
            if not res.succeeded:
                self.refused += 1
                self.metrics.refused.inc()
                log.warning("placement write refused: no longer leader", extra=kv(event="stale_leader"))
                self.election.lost.set()
                return 0
        self.writes += 1
        self.metrics.written.inc()
        for e in events:
            self.metrics.decided(e["action"])
            log.info("placement %s %s at %s: %s", e["action"], e["variant_id"], e["site"], e["reason"],
                     extra=kv(site=e["site"], variant=e["variant_id"], event=e["action"], reason=e["reason"]))
        return len(changed)
