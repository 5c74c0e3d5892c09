"""The site agent: the same process at every tier; tier and hardware come from the topology.

Lifecycle (start in this order, stop in reverse, each with a timeout):
store -> view (watch) -> variant host -> ZeroMQ server + client -> HTTP front -> gRPC front -> liveness ->
placement follower. Every background task is owned here and cancelled on stop.

The revocation list published at etcd ``pki/crl`` reaches both trust stores (edge TLS and CURVE) through the
view, so a revocation takes effect here even when this site's own ``crl.pem`` is stale; peers' certificates arrive
the same way, from ``pki/sites/`` (:mod:`edge_agent.agent_trust`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core_scheduler.policy.modes import Router, make_router
from core_scheduler.state.builds import BuildBook
from core_scheduler.state.heartbeat import Heartbeat, LoadedVariant
from core_scheduler.state.jobs import JobBook
from core_scheduler.state.scope import Scope
from core_scheduler.state.snapshot import SnapshotBuilder
from core_scheduler.state.view import MeshView
from edge_agent.agent_config import BLOB_PEER, AgentConfig
from edge_agent.agent_trust import AgentTrust
from edge_agent.blobs import PeerSource, blob_routes, peer_sources, public_blob
from edge_agent.chunks import ChunkWorker
from edge_agent.demand import DemandMeter
from edge_agent.device_memory import DeviceBudget, FixedDeviceMemory, detect_device_memory
from edge_agent.grpc_api import EdgeGrpcServer
from edge_agent.host import VariantHost
from edge_agent.http_api import EdgeHttpServer, identify
from edge_agent.jobs_api import JobsApi
from edge_agent.liveness import Liveness
from edge_agent.metrics import AgentMetrics, Gauges
from edge_agent.models_api import ModelsApi
from edge_agent.observe import Observe
from edge_agent.peer_keys import PeerAddresses, PeerKeys
from edge_agent.quota import DoorQuotas, PeerQuotas, limits_from_view
from edge_agent.selfprofile import SelfProfiler
from edge_agent.site_dataplane import SiteDataPlane
from edge_agent.stall_watch import StallWatch
from edge_agent.table_pacer import TablePacer, routing_inputs, same_routing
from edge_agent.traces import TraceStore
from mesh import clock
from mesh.addresses import advertised_host, tcp_endpoint
from mesh.errors import ConfigError, MeshError
from mesh.etcd.store import Store
from mesh.heap import settle
from mesh.lifecycle import Service, State, cancel_and_wait
from mesh.log import get_logger, kv
from mesh.pki.identity import Kind
from mesh.pki.site_names import server_site
from mesh.zmq.client import ZmqClient
from mesh.zmq.server import ZmqServer
from topology.paths import topology_paths
from variant_store.catalog import Catalog
from variant_store.data_client import DataClient
from variant_store.hardware import cpu_cap_cores, gpu_available, local_hardware_class, torch_serving

if TYPE_CHECKING:  # CURVE and mutual TLS load cryptography: imported where a secured agent builds them, so an
    # --insecure agent never loads it (the edge footprint)
    from mesh.zmq.curve import CurveSecurity

__all__ = ["Agent", "load_peer_map"]

log = get_logger(__name__)
# Batching keeps a core busy with several queries in flight; past this many per core the
# queue wait dominates and routing should look elsewhere.
INFLIGHT_PER_CORE = 8
GONE_UNLOAD_S = 10.0  # a loaded variant whose catalog entry is gone is unloaded once unused this long
SITE_KIND: tuple[Kind, ...] = ("site",)


class Agent(AgentTrust, Service):
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.site = cfg.site
        self.store: Store | None = None
        self.view: MeshView | None = None
        self.snapshots: SnapshotBuilder | None = None
        self.host: VariantHost | None = None
        self.selfprof: SelfProfiler | None = None
        self.zmq_server: ZmqServer | None = None
        self.zmq_client: ZmqClient | None = None
        self.stall_watch = StallWatch()  # a query that waited through a freeze of this process is charged from it
        self.curve: CurveSecurity | None = None
        self.peer_keys: PeerKeys | None = None  # the CURVE key each peer is dialled with (CURVE on)
        # where each peer is dialled and which of its URLs is used: what its certificate vouches for (CURVE on)
        self.peer_addresses: PeerAddresses | None = None
        self.http: EdgeHttpServer | None = None
        self.grpc: EdgeGrpcServer | None = None  # the Open Inference Protocol over gRPC (cfg.grpc_port None: off)
        self.chunks: ChunkWorker | None = None  # offline jobs' chunks, run on idle capacity (edge_agent.chunks)
        self.jobs_api: JobsApi | None = None  # the door's job API (its long polls and event streams end first)
        self.models_api: ModelsApi | None = None  # tenants register their own models here (issue 34)
        self.liveness: Liveness | None = None
        self.dataplane: SiteDataPlane | None = None
        self.table: Router | None = None
        self.table_version = 0
        self._table_sites: frozenset[str] = frozenset()
        self._table_inputs: tuple[object, ...] | None = None  # what the table in force was built from
        self._rebuild_later: asyncio.TimerHandle | None = None  # a paced rebuild, when one is due
        self.demand = DemandMeter(window_s=cfg.demand_window_s)
        self.quota = DoorQuotas()
        self.peer_quota = PeerQuotas()  # what each door may spend here of its tenants' quotas (forwarded)
        self._tasks: list[asyncio.Task[None]] = []
        self._reconcile = asyncio.Event()
        self._crl_seen: bytes | None = None  # the pki/crl PEM last handed to the trust stores
        self._certs_seen: dict[str, bytes] | None = None  # the pki/sites/ certificates last handed to CURVE
        self._published_pem: bytes | None = None  # our certificate as we last published it at pki/sites/<site>
        self._rekeying: asyncio.Task[None] | None = None  # taking our own re-issued CURVE key
        # refused here, before anything starts, when nobody could dial what we would advertise
        self.advertise_host = advertised_host(cfg.bind, cfg.advertise)
        if not 0.0 <= cfg.trace_sample_rate <= 1.0:
            raise ConfigError(f"trace sample rate must be in [0, 1], got {cfg.trace_sample_rate}")
        if cfg.trace_buffer < 1:
            raise ConfigError(f"trace buffer must hold at least 1 trace, got {cfg.trace_buffer}")
        self.metrics = AgentMetrics(cfg.site)
        self.metrics.gauges = self._gauges
        self.traces = TraceStore(cfg.trace_buffer)
        self.cpu_cap = cpu_cap_cores() or cfg.cpu_cap
        # load-only view changes rebuild the table at most under a share of this site's CPU (edge_agent.table_pacer)
        self.pacer = TablePacer(cores=self.cpu_cap or float(os.cpu_count() or 1))
        self.hardware_class = local_hardware_class(self.cpu_cap)
        self.gpu_ok, self.gpu_note = gpu_available()
        if not self.gpu_ok and torch_serving()[0]:
            self.gpu_ok, self.gpu_note = True, f"{torch_serving()[1]} through PyTorch (torch-cuda runtime)"

    # -- lifecycle -------------------------------------------------------------------------
    async def _start(self) -> None:
        cfg = self.cfg
        self.store = await Store.connect(cfg.etcd, cfg.prefix, ca=cfg.etcd_ca, cert=cfg.etcd_cert, key=cfg.etcd_key)
        self.view = MeshView(self.store, self.site, debounce_s=0.2,
                             scope=Scope(self.site, peers=cfg.route_peers, per_tier=cfg.route_per_tier))
        await self.view.start()
        self.snapshots = SnapshotBuilder(self.view, here=self.site)
        topo = self.view.topology
        if topo is None or self.site not in topo.sites:
            raise ConfigError(f"site {self.site!r} is not in the topology in etcd "
                              f"(apply one with `tiermesh topology apply FILE`)")
        me = topo.sites[self.site]
        budget = (cfg.model_memory_mb * 1024 * 1024 if cfg.model_memory_mb is not None
                  else int(me.hardware.memory_mb * 1024 * 1024 * cfg.model_memory_fraction))
        cache = cfg.home / "sites" / self.site / "blobs"
        cache.mkdir(parents=True, exist_ok=True)
        source = (FixedDeviceMemory(cfg.device_memory_mb << 20) if cfg.device_memory_mb is not None
                  else detect_device_memory())
        device = DeviceBudget.for_site((g.memory_mb for g in me.hardware.gpus), source, cfg.device_memory_fraction)
        log.info("device memory budget: %s", device.describe(), extra=kv(site=self.site, event="device_budget"))
        self.host = VariantHost(self.site, cache, hardware_class=self.hardware_class,
                                memory_budget_bytes=budget, threads=min(2, me.hardware.cpu_cores), settle_heap=True,
                                device_budget_bytes=device.budget_bytes,
                                idle_s=lambda: self.dataplane.idle_s() if self.dataplane is not None else 1e9)
        metrics = self.metrics
        self.host.on_load = lambda vid, prewarm: metrics.cold_start(vid, prewarm=prewarm)
        self.host.on_batch = metrics.batch_ran
        self.host.blobs.peer_sources = self._blob_peers
        self.selfprof = SelfProfiler(self.site, self.host, self.view, wanted=self._placed,
                                     idle_s=lambda: self.dataplane.idle_s() if self.dataplane is not None else 0.0,
                                     published_cb=self._beat_now)
        tls = None
        if cfg.tls:  # its credentials first: an edge without them says so (PkiError), whatever CURVE would say
            from edge_agent.mtls import EdgeTls

            tls = EdgeTls(self._pki_paths(), self.site)
        self.curve = await self._open_curve()
        if self.curve is not None:
            view = self.view
            self.peer_addresses = PeerAddresses(self.site, self.curve.sites, cfg.peer_map)
            self.peer_addresses.update(view.live)
            self.curve.sites.on_change.append(self._believe_peers)
            self.peer_keys = PeerKeys(self.site, self.curve.sites, lambda: view.live, self._peer_endpoint)
        self.zmq_client = ZmqClient(security=self.curve,
                                    server_key_for=self.peer_keys.server_key if self.peer_keys else None)
        self.dataplane = SiteDataPlane(self.site, self.view, self.host, self.zmq_client,
                                       table=lambda: self.table, peer_endpoint=self._peer_endpoint,
                                       demand=self.demand, quota=self.quota, metrics=self.metrics,
                                       traces=self.traces, trace_sample_rate=cfg.trace_sample_rate,
                                       peer_quota=self.peer_quota)
        self.dataplane.secured = self.curve is not None
        await self.stall_watch.start()
        self.zmq_server = ZmqServer(self.dataplane.infer_from_peer, bind=tcp_endpoint(cfg.bind, cfg.zmq_port),
                                    max_bytes=cfg.max_body_bytes, security=self.curve,
                                    arrival=self.stall_watch.arrival)
        await self.zmq_server.start()
        observe = Observe(self.metrics, self.traces, tls)
        host = self.host
        job_data = DataClient(lambda: host.blobs.store_url, lambda: host.blobs.ssl)
        jobs = JobsApi(self.site, self.view, JobBook(self.store), job_data,
                       cfg.home / "sites" / self.site / "jobs-spool", tls.tenant if tls is not None else identify,
                       on_admit=lambda: self.chunks.wake() if self.chunks is not None else None)
        self.jobs_api = jobs
        self.models_api = models = ModelsApi(
            self.site, self.view, BuildBook(self.store), Catalog(self.store), job_data,
            cfg.home / "sites" / self.site / "models-spool", tls.tenant if tls is not None else identify)
        self.http = EdgeHttpServer(self.dataplane, host=cfg.bind, port=cfg.http_port,
                                   advertise=self.advertise_host, max_body_bytes=cfg.max_body_bytes,
                                   tls=tls, observe=observe,
                                   routes=tuple(blob_routes(cache, tls, self._public_blob)),
                                   visible=self.dataplane.visible, quota_check=self.quota.check,
                                   stall_watch=self.stall_watch,
                                   tenant_routes=(*jobs.routes(), *models.routes()))
        await self.http.start()
        if cfg.grpc_port is not None:  # after the HTTP front: it starts the TLS side both share
            self.grpc = EdgeGrpcServer(self.dataplane, host=cfg.bind, port=cfg.grpc_port, advertise=self.advertise_host,
                                       max_message_bytes=cfg.max_body_bytes, tls=tls, visible=self.dataplane.visible,
                                       quota_check=self.quota.check, rejected=observe.rejected, metrics=self.metrics,
                                       arrival=self.stall_watch.arrival, models=models.registrar)
            await self.grpc.start()
        # blobs from an https:// variant store or peer: with the site's own (reloading) client certificate; a peer
        # must prove to be the site it is fetched from
        if self.http.tls is not None:
            edge_tls = self.http.tls
            self.host.blobs.ssl = edge_tls.credentials.client_context()
            self.host.blobs.verify_server = lambda ssl_object: server_site(
                ssl_object, lambda cert: edge_tls.trust.verify(cert, use="server", kinds=SITE_KIND))
        # trust first (peers' certificates, the revocation list), so routing and re-dialling see it
        self.view.on_change(self._adopt_crl)
        self.view.on_change(self._adopt_site_certs)
        self.view.on_change(self._on_view_change)
        self.view.on_change(self.selfprof.wake)
        self._adopt_crl()
        self._on_view_change()
        self.liveness = Liveness(self.store, self.site, self._live_record, ttl_s=cfg.lease_ttl_s,
                                 interval_s=cfg.heartbeat_s)
        await self.liveness.start()
        dataplane = self.dataplane
        self.chunks = ChunkWorker(self.site, self.store, self.view, self.host, job_data,
                                  cfg.home / "sites" / self.site / "jobs", lambda: dataplane.inflight > 0)
        await self.chunks.start()
        self._tasks.append(asyncio.create_task(self._reconcile_loop(), name=f"reconcile:{self.site}"))
        self._tasks.append(asyncio.create_task(self.selfprof.run(), name=f"self-profile:{self.site}"))
        self.selfprof.wake()
        settle("agent start")  # what start made is long-lived: out of the collector's full passes (mesh.heap)
        log.info("agent up: zmq %s (bound %s) http %s grpc %s (%s%s)", self.zmq_endpoint, self.zmq_server.endpoint,
                 self.http.url, self.grpc.url if self.grpc is not None else "off",
                 self.hardware_class, "" if self.gpu_ok else f"; {self.gpu_note}",
                 extra=kv(site=self.site, event="agent_up"))

    async def _stop(self) -> None:
        if self._rebuild_later is not None:
            self._rebuild_later.cancel()
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(*tasks, self._rekeying)
        steps: list[Any] = [self.chunks.stop if self.chunks else None,
                            self.liveness.stop if self.liveness else None,
                            self.grpc.stop if self.grpc else None,
                            self.jobs_api.close if self.jobs_api else None,
                            self.models_api.close if self.models_api else None,
                            self.http.stop if self.http else None,
                            self.zmq_server.stop if self.zmq_server else None,
                            self.stall_watch.stop,
                            self.zmq_client.close if self.zmq_client else None,
                            self.curve.sites.stop if self.curve else None,
                            self.host.close if self.host else None,
                            self.view.stop if self.view else None,
                            self.store.close if self.store else None]
        for step in steps:
            if step is None:
                continue
            try:
                async with asyncio.timeout(10.0):
                    await step()
            except Exception:
                log.exception("shutdown step failed", extra=kv(site=self.site))

    # -- state -----------------------------------------------------------------------------
    @property
    def zmq_endpoint(self) -> str:
        """The ZeroMQ endpoint peers dial: the advertised host with the port really bound."""
        assert self.zmq_server is not None
        port = int(self.zmq_server.endpoint.rsplit(":", 1)[1])
        return tcp_endpoint(self.advertise_host, port)

    @property
    def http_url(self) -> str:
        """The HTTP(S) base URL callers use (advertised host, bound port)."""
        assert self.http is not None
        return self.http.url

    @property
    def grpc_url(self) -> str | None:
        """The gRPC front's URL (``grpcs://host:port``, advertised host, bound port); None when it is off."""
        return self.grpc.url if self.grpc is not None else None

    def _public_blob(self, digest: str) -> bool:
        """Whether a public variant of the catalog is built on blob ``digest`` (only those go to peers)."""
        view = self.view
        return view is not None and public_blob(digest, (m for vs in view.variants.values() for m in vs.values()))

    def _blob_peers(self, digest: str) -> list[PeerSource]:
        """Where a blob can be fetched from before the variant store: live peers holding it, nearest first."""
        view = self.view
        topo = view.topology if view is not None else None
        if view is None or topo is None:
            return []
        paths = topology_paths(topo)
        here = paths.index.get(self.site)

        def rtt(site: str) -> float:
            there = paths.index.get(site)
            return float(paths.rtt_ms[here, there]) if here is not None and there is not None else float("inf")

        by_id = {vid: meta for vs in view.variants.values() for vid, meta in vs.items()}
        return peer_sources(digest, self.site, view.live, rtt, by_id.get, self._peer_http)

    def _on_view_change(self) -> None:
        if self.state is State.STOPPING:  # its servers are going: a change now has nothing left to route
            return
        assert self.view is not None and self.host is not None and self.zmq_client is not None
        svc = self.view.services.get("variant-store")
        announced = svc.get("url") if isinstance(svc, dict) else None
        self.host.blobs.store_url = self.cfg.peer_map.get(BLOB_PEER) or announced
        topo = self.view.topology
        self.metrics.known(tasks=[*self.view.signatures, *self.view.pipelines], tenants=topo.tenants if topo else (),
                           variants=(vid for vs in self.view.variants.values() for vid in vs),
                           sites=topo.sites if topo else ())
        # this door's share of each tenant's quota follows the heartbeats (core_scheduler.policy.quota)
        quotas = {t.name: t.quotas for t in topo.tenants.values()} if topo else {}
        self.quota.update(limits_from_view(self.site, quotas, self.view.live))
        self.peer_quota.update(quotas, self.view.live)
        self._believe_peers()
        # sites whose lease ended: fail what is pending to them now, not at the deadline
        for site, endpoint in self.cfg.peer_map.items():
            if site != BLOB_PEER and site not in self.view.live:
                self.zmq_client.fail_peer(endpoint, f"{site} lease expired")
        if self.curve is not None:
            self._redial_rotated()
        # live peers: connect ahead of the first query (the handshake costs WAN round trips)
        for site in self.view.live:
            if site != self.site and (peer := self._peer_endpoint(site)):
                self.zmq_client.connect(peer)
        structural = bool(self.view.changes - {"live"}) or frozenset(self.view.live) != self._table_sites
        wait = self.pacer.wait_s(time.monotonic(), structural=structural or self.table is None)
        if wait <= 0.0:
            self._rebuild_table(force=structural)
        elif self._rebuild_later is None:  # load reports only, and a rebuild ran lately: the next one then
            self._rebuild_later = asyncio.get_running_loop().call_later(wait, self._rebuild_table)

    def _rebuild_table(self, force: bool = False) -> None:
        """The routing table from the view as it is now, built on the event loop (paced for load-only changes:
        :mod:`edge_agent.table_pacer`). Built in a worker thread instead, it took the GIL from the queries it was
        meant to spare: at a 0.1-core edge the demo's tight class met 95.9 and 96.6 % that way, 99.0 and 99.3 % so.
        ``force``: a change of what the mesh is (catalog, placement, a site joining or leaving) always builds; for
        heartbeats alone a build that would route as the table in force is skipped."""
        if self._rebuild_later is not None:
            self._rebuild_later.cancel()
            self._rebuild_later = None
        if self.state is State.STOPPING or self.view is None or self.snapshots is None:
            return
        started = time.thread_time()
        correction = self.dataplane.rtt_correction() if self.dataplane else None
        snap = self.snapshots.build(local_loads=self._local_load(), rtt_correction=correction)
        if snap is None:
            self.table, self._table_inputs = None, None
            return
        inputs = routing_inputs(snap, correction, self.view.revisions, self.view.generation)
        if not force and self.table is not None and \
                same_routing(self._table_inputs, inputs, time.monotonic() - self.pacer.last):
            return  # heartbeats only, and the table in force routes as this one would (edge_agent.table_pacer)
        self.table = make_router(self.cfg.routing_mode, snap, self.site)
        if self.dataplane is not None:
            self.dataplane.table_correction = dict(correction or {})
        self.table_version = snap.version
        self._table_sites = frozenset(self.view.live)
        self._table_inputs = inputs
        self.pacer.observe(time.thread_time() - started, time.monotonic())
        self._reconcile.set()

    def _gauges(self) -> Gauges:
        """What ``/metrics`` reports as gauges, read when it is scraped."""
        host, dp, view = self.host, self.dataplane, self.view
        loaded = {vid: (lv.runtime.memory_bytes, lv.batcher.queued_rows)
                  for vid, lv in host.loaded.items()} if host is not None else {}
        down = dp.unreachable if dp is not None else frozenset()
        peers = {s: s not in down for s in view.live if s != self.site} if view is not None else {}
        return Gauges(loaded=loaded, peers=peers, etcd_connected=bool(view and view.connected),
                      inflight=dp.inflight if dp is not None else 0,
                      device_used_bytes=host.device_used_bytes if host is not None else 0,
                      device_budget_bytes=(host.device_budget_bytes or 0) if host is not None else 0)

    def _local_load(self) -> Heartbeat | None:
        return self._live_record() if self.host is not None else None

    def _live_record(self) -> Heartbeat:
        assert self.host is not None and self.zmq_server is not None and self.http is not None
        assert self.dataplane is not None
        topo = self.view.topology if self.view else None
        me = topo.sites.get(self.site) if topo else None
        mem_total = int(me.hardware.memory_mb * 1024 * 1024) if me else 0
        loaded = {vid: LoadedVariant(task=lv.meta.task, queue_ms=round(lv.batcher.expected_wait_ms(), 3),
                                     queued_rows=lv.batcher.queued_rows,
                                     ewma_compute_ms=round(lv.batcher.ewma_compute_ms, 3),
                                     served=lv.batcher.served, load_ms=round(lv.load_ms, 1),
                                     memory_bytes=lv.memory_bytes)
                  # a strict tenant's own instances too; the shared one's record wins (sorted last)
                  for (vid, _), lv in sorted(self.host.instances.items(), key=lambda kv: -len(kv[0][1]))}
        return Heartbeat(
            site=self.site, ts=clock.wall(), tier=me.tier if me else None,
            hardware_class=self.hardware_class,
            declared_hardware_class=me.hardware.hardware_class if me else None,
            gpu=self.gpu_ok, gpu_note=self.gpu_note,
            endpoint=self.zmq_endpoint, curve_key=self.curve.public_key if self.curve else None,
            http=self.http_url,
            loaded=loaded, inflight=self.dataplane.inflight,
            capacity=(me.hardware.cpu_cores if me else 1) * INFLIGHT_PER_CORE,
            memory_total_bytes=mem_total,
            model_memory_budget_bytes=self.host.memory_budget_bytes,
            memory_used_bytes=self.host.memory_used_bytes,
            device_memory_budget_bytes=self.host.device_budget_bytes or 0,
            device_memory_used_bytes=self.host.device_used_bytes,
            served=self.dataplane.served, forwarded=self.dataplane.forwarded,
            cold_starts=self.host.cold_starts,
            demand=tuple(self.demand.snapshot(time.monotonic())),
            degraded=bool(self.liveness and self.liveness.degraded),
            view_revision=self.view.revision if self.view else 0,
            peer_rtt_ms=dict(self.dataplane.net_rtt_ms), cpu_cap=self.cpu_cap,
            profiles=self.selfprof.published() if self.selfprof is not None else {},
            profiling_pending=self.selfprof.pending if self.selfprof is not None else 0,
            settling=self.host.settling)

    async def _reconcile_loop(self) -> None:
        """Follow ``placement/<site>``: load what is desired, unload what is neither desired nor used."""
        while True:
            with contextlib.suppress(TimeoutError):  # not wait_for: see SelfProfiler.run
                async with asyncio.timeout(5.0):
                    await self._reconcile.wait()
            self._reconcile.clear()
            try:
                await self._reconcile_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile failed", extra=kv(site=self.site))

    async def _beat_now(self) -> None:
        if self.liveness is not None:
            await self.liveness.beat()

    def _placed(self) -> set[str]:
        """The variants placement asks of this site."""
        placement = (self.view.placement.get(self.site) if self.view is not None else None) or {}
        return {str(v["variant_id"]) for v in placement.get("variants", [])}

    async def _reconcile_once(self) -> None:
        assert self.view is not None and self.host is not None
        placement = self.view.placement.get(self.site) or {}
        desired = {(v["task"], v["variant_id"]) for v in placement.get("variants", [])}
        loaded = 0
        for task, vid in sorted(desired):
            meta = self.view.variant(task, vid)
            if meta is None or vid in self.host.loaded:
                continue
            try:
                await self.host.ensure(meta, prewarm=True)
                loaded += 1
            except MeshError as exc:
                log.warning("cannot load %s: %s", vid, exc, extra=kv(site=self.site, variant=vid))
        if loaded and self.liveness is not None:  # what placement asked for is served: say so now, not next beat
            await self.liveness.beat()
        wanted = {vid for _, vid in desired}
        now = time.monotonic()
        for (vid, isolated_for), lv in list(self.host.instances.items()):
            if (vid in wanted and not isolated_for) or lv.batcher.queued_rows:
                continue
            # a variant the catalog no longer has (a tenant deleted its task, a version retired) can never be routed
            # to again: unloaded once nothing has used it for GONE_UNLOAD_S (a query let in just before it went
            # finishes), not after the idle timeout meant for variants that may be wanted again
            gone = self.view.variant(lv.meta.task, vid) is None
            if now - lv.last_used > (GONE_UNLOAD_S if gone else self.cfg.idle_unload_s):
                await self.host.unload(vid, isolated_for)


def load_peer_map(path: Path | None) -> dict[str, str]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read peer map {path}: {exc}") from exc
    return {str(k): str(v) for k, v in data.items()}
