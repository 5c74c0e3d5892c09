"""A whole mesh on one machine: embedded etcd, variant store, scheduler, one agent process per site,
and every site-to-site path made real by userspace TCP delay proxies (loopback only).

``tiermesh up``, the system tests and the geo benchmarks all stand on this. It can kill and restart
a site, cut and restore a link, and stop and restart etcd on cue. Everything it starts it stops,
in reverse order, even when a step fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

from core_scheduler.scheduler import Scheduler, SchedulerConfig
from edge_agent.agent import BLOB_PEER
from mesh.errors import ConfigError, MeshError, StoreError
from mesh.etcd.cluster import EtcdCluster
from mesh.etcd.keys import live_key
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.lifecycle import Service
from mesh.log import get_logger, kv
from tiermesh.delayproxy import LinkShape, ProxyPool
from topology.loader import load_topology_file
from topology.paths import topology_paths
from topology.schema import Topology
from topology.store_io import apply as apply_topology
from variant_store.blobs import BlobStore
from variant_store.build import ensure_digits_family
from variant_store.catalog import Catalog
from variant_store.server import VariantStoreServer

__all__ = ["LocalMesh", "MeshOptions", "SiteProcess", "path_shape"]

log = get_logger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def path_shape(topology: Topology, src: str, dst: str, *, jitter: bool = True) -> LinkShape:
    """The delay proxy's shape from ``src`` to ``dst``: the one-way latency and bottleneck bandwidth
    of the path routing plans on (:mod:`topology.paths`, so an equal-cost tie resolves the same
    way here and in the RTT table). ``jitter``: the largest declared jitter of a link at either
    end, at most a quarter of the latency (the blob proxy runs without)."""
    paths = topology_paths(topology)
    one_way = paths.path_latency_ms(src, dst)
    bandwidth = paths.bottleneck_bandwidth_mbps(src, dst)
    if not jitter:
        return LinkShape(latency_ms=one_way, bandwidth_mbps=bandwidth)
    spread = max((lk.jitter_ms for lk in topology.links if src in lk.ends or dst in lk.ends), default=0.0)
    return LinkShape(latency_ms=one_way, jitter_ms=min(spread, one_way / 4), bandwidth_mbps=bandwidth)


@dataclass(slots=True)
class MeshOptions:
    topology: Path
    home: Path
    prefix: str = "/tiermesh/"
    lease_ttl_s: float = 3.0
    wan: bool = True                 # delay proxies between sites (False: direct loopback)
    scheduler: bool = True
    sites: list[str] | None = None   # None: every site of the topology
    agent_log_level: str = "WARNING"
    startup_timeout_s: float = 90.0
    mode: str = "tiermesh"          # routing + placement mode (baselines for benchmarks)
    proactive: bool = True           # scheduler forecasts demand and prewarms
    agent_env: dict[str, str] = field(default_factory=dict)  # extra environment of every agent
    # where the variant store lives in the topology (None: the first core site): with ``wan``,
    # every other site fetches blobs over that site's path, so a cold start pays a real WAN fetch
    store_site: str | None = None
    etcd_members: int = 1            # >1: a local etcd cluster (agents and scheduler get every member's URL)
    # scheduler knobs (None: SchedulerConfig / PlacementConfig defaults); benchmarks compress time
    interval_s: float | None = None
    forecast_horizon_s: float | None = None
    forecast_period_s: float | None = None
    forecast_bin_s: float | None = None
    idle_evict_s: float | None = None
    min_residency_s: float | None = None

    def scheduler_config(self, candidate_id: str) -> SchedulerConfig:
        cfg = SchedulerConfig(candidate_id=candidate_id, mode=self.mode, proactive=self.proactive)
        for name in ("interval_s", "forecast_horizon_s", "forecast_period_s", "forecast_bin_s"):
            value = getattr(self, name)
            if value is not None:
                setattr(cfg, name, value)
        if self.idle_evict_s is not None:
            cfg.placement = replace(cfg.placement, idle_evict_s=self.idle_evict_s)
        if self.min_residency_s is not None:
            cfg.placement = replace(cfg.placement, min_residency_s=self.min_residency_s)
        return cfg


@dataclass(slots=True)
class SiteProcess:
    name: str
    zmq_port: int
    proc: asyncio.subprocess.Process | None = None
    http: str | None = None
    log_path: Path | None = None
    peer_map_path: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


class LocalMesh(Service):
    def __init__(self, opts: MeshOptions) -> None:
        self.opts = opts
        self.topology: Topology = load_topology_file(opts.topology)
        self.etcd: EmbeddedEtcd | EtcdCluster | None = None
        self.store: Store | None = None
        self.blobs: BlobStore | None = None
        self.catalog: Catalog | None = None
        self.variant_server: VariantStoreServer | None = None
        self.scheduler: Scheduler | None = None
        self.proxies = ProxyPool()
        self.sites: dict[str, SiteProcess] = {}
        self.etcd_port = _free_port()
        self.etcd_peer_port = _free_port()

    @property
    def etcd_url(self) -> str:
        """Every etcd member's URL, comma-separated (one URL without a cluster)."""
        if isinstance(self.etcd, EtcdCluster) and self.etcd.members:
            return self.etcd.url
        return f"http://127.0.0.1:{self.etcd_port}"

    # -- lifecycle -------------------------------------------------------------------------
    async def _start(self) -> None:
        home = self.opts.home
        home.mkdir(parents=True, exist_ok=True)
        await self.start_etcd()
        assert self.store is not None
        diff = await apply_topology(self.store, self.topology)
        log.info("topology applied: %s", diff.summary() if hasattr(diff, "summary") else diff,
                 extra=kv(event="topology_apply"))
        self.blobs = BlobStore(home / "blobs")
        self.catalog = Catalog(self.store)
        await ensure_digits_family(self.catalog, self.blobs)
        self.variant_server = VariantStoreServer(self.blobs, self.catalog, site=self._store_site())
        await self.variant_server.start()
        if self.opts.scheduler:
            self.scheduler = Scheduler(self.store, self.opts.scheduler_config(f"up-{os.getpid()}"))
            await self.scheduler.start()
        names = self.opts.sites or sorted(self.topology.sites)
        for name in names:
            if name not in self.topology.sites:
                raise ConfigError(f"site {name!r} is not in {self.opts.topology}")
            # port 0: each agent binds its own (reserving ports here and releasing them raced with
            # the proxies' own listening ports); the proxies learn the real port when it is ready
            self.sites[name] = SiteProcess(name=name, zmq_port=0)
        if self.opts.wan:
            await self._start_proxies()
        await asyncio.gather(*(self.start_site(n) for n in names))

    async def _stop(self) -> None:
        for name in list(self.sites):
            with contextlib.suppress(Exception):
                await self.kill_site(name, graceful=True)
        await self.proxies.stop()
        for step in (self.scheduler.stop if self.scheduler else None,
                     self.variant_server.stop if self.variant_server else None):
            if step is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(step(), 10)
        self.scheduler = None
        self.variant_server = None
        await self.stop_etcd()

    # -- etcd ------------------------------------------------------------------------------
    async def start_etcd(self) -> None:
        """Start etcd, or start it again after ``stop_etcd`` on the same ports and data dir: every
        process keeps its URL, and the kept Store reconnects (waited for here)."""
        if self.etcd is None and self.opts.etcd_members > 1:
            self.etcd = EtcdCluster(self.opts.home / "etcd", size=self.opts.etcd_members)
        elif self.etcd is None:
            self.etcd = EmbeddedEtcd(self.opts.home / "etcd", client_port=self.etcd_port,
                                     peer_port=self.etcd_peer_port)
        await self.etcd.start()
        if self.store is None:
            self.store = await Store.connect(self.etcd_url, self.opts.prefix)
            return
        deadline = time.monotonic() + 15.0
        while True:
            try:
                await self.store.revision()
                return
            except StoreError as exc:
                if time.monotonic() > deadline:
                    raise MeshError(f"store did not reconnect to the restarted etcd: {exc}") from exc
                await asyncio.sleep(0.1)

    async def stop_etcd(self, *, keep_store: bool = False) -> None:
        """Stop etcd (its data stays). ``keep_store``: keep the harness's Store for a later
        ``start_etcd`` (an outage), instead of closing it (the end of the mesh)."""
        if self.store is not None and not keep_store:
            with contextlib.suppress(Exception):
                await self.store.close()
            self.store = None
        if self.etcd is not None:
            with contextlib.suppress(Exception):
                await self.etcd.stop(keep_data=True)

    # -- WAN emulation ---------------------------------------------------------------------
    async def _start_proxies(self) -> None:
        for src in self.sites:
            peer_map: dict[str, str] = {}
            for dst, sp in self.sites.items():
                if dst == src:
                    continue
                shape = path_shape(self.topology, src, dst)
                proxy = await self.proxies.add(src, dst, ("127.0.0.1", sp.zmq_port), shape)
                peer_map[dst] = proxy.endpoint
            blob_proxy = await self._blob_proxy(src)
            if blob_proxy is not None:
                peer_map[BLOB_PEER] = blob_proxy
            path = self.opts.home / "sites" / src / "peers.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(peer_map, indent=1))
            self.sites[src].peer_map_path = path

    def _store_site(self) -> str | None:
        if self.opts.store_site is not None:
            if self.opts.store_site not in self.topology.sites:
                raise ConfigError(f"store_site {self.opts.store_site!r} is not in {self.opts.topology}")
            return self.opts.store_site
        cores = sorted(n for n, s in self.topology.sites.items() if s.tier == "core")
        return cores[0] if cores else None

    async def _blob_proxy(self, src: str) -> str | None:
        """URL through which ``src`` reaches the variant store over its path to the store's site."""
        home_site = self._store_site()
        if home_site is None or home_site == src or self.variant_server is None:
            return None
        url = urlsplit(self.variant_server.url)
        if url.hostname is None or url.port is None:
            return None
        shape = path_shape(self.topology, src, home_site, jitter=False)
        proxy = await self.proxies.add(src, BLOB_PEER, (url.hostname, url.port), shape)
        return f"http://{proxy.listen_host}:{proxy.port}"

    async def cut_link(self, a: str, b: str) -> None:
        for key in ((a, b), (b, a)):
            if key in self.proxies.proxies:
                await self.proxies.proxies[key].cut()

    def restore_link(self, a: str, b: str) -> None:
        for key in ((a, b), (b, a)):
            if key in self.proxies.proxies:
                self.proxies.proxies[key].restore()

    # -- sites -----------------------------------------------------------------------------
    async def start_site(self, name: str) -> None:
        sp = self.sites[name]
        ready = self.opts.home / "sites" / name / "ready.json"
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.unlink(missing_ok=True)
        sp.log_path = self.opts.home / "sites" / name / "agent.log"
        cmd = [sys.executable, "-m", "tiermesh", "agent", "--site", name, "--etcd", self.etcd_url,
               "--prefix", self.opts.prefix, "--home", str(self.opts.home), "--zmq-port", "0",
               "--lease-ttl", str(self.opts.lease_ttl_s), "--ready-file", str(ready),
               "--routing-mode", self.opts.mode]
        if sp.peer_map_path is not None:
            cmd += ["--peer-map", str(sp.peer_map_path)]
        env = {**os.environ, "TIERMESH_LOG_LEVEL": self.opts.agent_log_level, **self.opts.agent_env,
               **sp.extra_env}
        logf = sp.log_path.open("ab")
        try:
            sp.proc = await asyncio.create_subprocess_exec(*cmd, stdout=logf, stderr=logf, env=env,
                                                           stdin=asyncio.subprocess.DEVNULL)
        finally:
            logf.close()  # the child holds its own descriptor
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while not ready.exists():
            if sp.proc.returncode is not None:
                raise MeshError(f"agent {name} exited with {sp.proc.returncode}; see {sp.log_path}")
            if time.monotonic() > deadline:
                raise MeshError(f"agent {name} not ready in {self.opts.startup_timeout_s:.0f} s; "
                                f"see {sp.log_path}")
            await asyncio.sleep(0.1)
        info = json.loads(ready.read_text())
        sp.http = info["http"]
        sp.zmq_port = int(str(info["zmq"]).rsplit(":", 1)[1])
        for (_, dst), proxy in self.proxies.proxies.items():
            if dst == name:
                proxy.set_upstream("127.0.0.1", sp.zmq_port)

    async def kill_site(self, name: str, *, graceful: bool = False) -> None:
        """SIGKILL (a crash: its lease must expire) or SIGTERM (a clean stop)."""
        sp = self.sites[name]
        proc, sp.proc = sp.proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def wait_live(self, names: list[str] | None = None, timeout: float = 30.0) -> None:  # noqa: ASYNC109
        assert self.store is not None
        deadline = time.monotonic() + timeout
        for name in names or list(self.sites):
            while await self.store.get(live_key(name)) is None:
                if time.monotonic() > deadline:
                    raise MeshError(f"site {name} not live after {timeout} s")
                await asyncio.sleep(0.1)

    async def wait_placed(self, timeout: float = 60.0) -> None:  # noqa: ASYNC109
        """Until every site holds what its placement asks (or the timeout: placement keeps going)."""
        assert self.store is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = 0
            for name in self.sites:
                place = await self.store.get(f"placement/{name}")
                live = await self.store.get(live_key(name))
                if place is None or live is None:
                    pending += 1
                    continue
                want = {v["variant_id"] for v in place.value.get("variants", [])}
                have = set(live.value.get("loaded") or {})
                pending += len(want - have)
            if pending == 0:
                return
            await asyncio.sleep(0.25)
        log.warning("placement not complete after %.0f s", timeout, extra=kv(event="placement_wait"))

    def edge_urls(self) -> dict[str, str]:
        return {n: sp.http for n, sp in self.sites.items()
                if sp.http and self.topology.sites[n].tier == "edge"}
