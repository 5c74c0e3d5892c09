"""A whole mesh on one machine: embedded etcd, variant store, scheduler, one agent process per site,
and every site-to-site path made real by userspace TCP delay proxies.

With ``netns`` (root) every participant is a host of its own instead (:mod:`tiermesh.netns`): etcd,
the control services (variant store + scheduler, then child processes) and each site run in their
own network namespace with their own address on one bridge; the delay proxies listen on the root
namespace's address on that bridge, so site-to-site traffic still crosses them, and :meth:`drill`
cuts or black-holes a link with packet filters inside the namespaces.

``tiermesh up``, the system tests and the geo benchmarks all stand on this. It can kill and restart
a site, cut and heal a link, and stop and restart etcd on cue. Everything it starts it stops,
in reverse order, even when a step fails.

With ``tls`` the whole mesh is secured (:mod:`tiermesh.secure`): the harness makes (or reuses) the mesh CA
under ``home/pki`` and issues (or keeps while good: ``LocalPki.renew``) a certificate per site (naming the address
callers dial), per tenant of the topology (and ``public``), for the operator, the scheduler and etcd; the edge APIs
speak HTTPS with client certificates, sites talk CURVE, etcd runs with TLS, client-certificate auth and RBAC per
role, and the variant store serves HTTPS with per-tenant authorization. :meth:`tenant_files` hands a tenant's files
to SDK clients. Without it the agents run ``--insecure`` (plain HTTP, tenant from a header), as most tests and
benchmarks expect.

With ``console`` the admin console runs beside the scheduler (:class:`console.ConsoleServer`): with ``tls`` over
HTTPS as ``scheduler/console``, scraping the agents as ``admin/console``, and an ``admin/admin`` certificate
(PEM and PKCS#12, :meth:`admin_files`) for the person at the browser; without, over HTTP with a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from console import ConsoleConfig, ConsoleServer, new_token
from console.app import Route
from core_scheduler.scheduler import Scheduler
from mesh.errors import ConfigError, MeshError, StoreError
from mesh.etcd import rbac
from mesh.etcd.cluster import EtcdCluster
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.reload import ReloadingCredentials
from tiermesh.caps import CpuCgroups, SiteCaps, machine_memory_mb, plan_caps
from tiermesh.control import ControlCommand, ControlOptions, ControlProcesses, PrefixedEtcd, terminate
from tiermesh.delayproxy import ProxyPool
from tiermesh.identities import CONSOLE_SCRAPER, CONSOLE_SERVER, MeshIdentities
from tiermesh.lab_hosts import HostHomes
from tiermesh.launcher import AgentLauncher
from tiermesh.membership_ops import Membership
from tiermesh.mesh_options import MeshOptions, SiteProcess, free_port, logs_dir, site_log
from tiermesh.netns import NetnsLab
from tiermesh.readiness import Readiness
from tiermesh.secure import OPERATOR, SCHEDULER, STORE, MeshCredentials, rbac_plan
from tiermesh.wan import WanLinks
from topology.loader import load_topology_file
from topology.schema import Topology
from topology.store_io import apply as apply_topology
from variant_store.access import StoreTls
from variant_store.blobs import BlobStore
from variant_store.build import ensure_digits_family
from variant_store.build_text import ensure_text_family
from variant_store.catalog import Catalog
from variant_store.data_area import DataArea
from variant_store.data_quotas import DataQuotaFollower
from variant_store.server import VariantStoreServer

__all__ = ["LocalMesh"]

log = get_logger(__name__)


class LocalMesh(Readiness, MeshIdentities, HostHomes, Membership, WanLinks, Service):
    def __init__(self, opts: MeshOptions) -> None:
        self.opts = opts
        self.topology: Topology = load_topology_file(opts.topology)
        self.etcd: EmbeddedEtcd | EtcdCluster | None = None
        self.store: Store | None = None
        self.blobs: BlobStore | None = None
        self.catalog: Catalog | None = None
        self.variant_server: VariantStoreServer | None = None
        self.data_quotas: DataQuotaFollower | None = None  # the in-process store's tenants' storage_mb
        self.scheduler: Scheduler | None = None
        self.proxies = ProxyPool()
        self.sites: dict[str, SiteProcess] = {}
        self.lab: NetnsLab | None = None
        self.store_url: str | None = None          # the variant store's advertised URL
        self.control: ControlProcesses | None = None  # variant store + scheduler in the ctl namespace
        self.console: ConsoleServer | None = None
        self.launcher: AgentLauncher | None = None
        self._launcher_start: asyncio.Task[None] | None = None
        self._crl_follow: list[Service] = []  # etcd's CRL file (and the in-process store's list) from pki/crl
        # in a namespace of its own etcd has its ports to itself
        self.pki = LocalPki.under(opts.home) if opts.tls else None
        self.creds = MeshCredentials(self.pki) if self.pki is not None else None
        self._sched_store: Store | None = None     # the in-process scheduler's own etcd identity (with tls)
        self.site_caps: dict[str, SiteCaps] = {}
        self.cgroups: CpuCgroups | None = None
        self.etcd_port = 2379 if opts.netns else free_port()
        self.etcd_peer_port = 2380 if opts.netns else free_port()

    @property
    def etcd_url(self) -> str:
        """Every etcd member's URL, comma-separated (one URL without a cluster)."""
        if isinstance(self.etcd, EtcdCluster) and self.etcd.members:
            return self.etcd.url
        scheme = "https" if self.creds is not None else "http"
        return f"{scheme}://{self._address('etcd')}:{self.etcd_port}"

    def _address(self, role: str) -> str:
        """Where ``role`` (a site, ``etcd`` or ``ctl``) listens: its namespace's address, or loopback."""
        return self.lab.host(role).address if self.lab is not None else "127.0.0.1"

    def _exec_prefix(self, role: str) -> list[str]:
        return self.lab.host(role).exec_prefix() if self.lab is not None else []

    # -- lifecycle -------------------------------------------------------------------------
    async def _start(self) -> None:
        home = self.opts.home
        home.mkdir(parents=True, exist_ok=True)
        names = self.opts.sites or sorted(self.topology.sites)
        for name in names:
            if name not in self.topology.sites:
                raise ConfigError(f"site {name!r} is not in {self.opts.topology}")
        for name in self.opts.joins:
            if name not in names:
                raise ConfigError(f"joining site {name!r} is not one of this mesh's sites {names}")
        started = [n for n in names if n not in self.opts.joins]  # the others are added later (join_site)
        if self.opts.caps:
            self._plan_caps(names)
        if self.opts.netns:
            self.lab = NetnsLab(["etcd", "ctl", *names])
            await self.lab.start()
            assert self.lab.subnet is not None
            self.proxies = ProxyPool(self.lab.root_address, (self.lab.subnet,))
        elif self.opts.fork_agents:  # its imports overlap etcd's start and the catalog check
            self.launcher = AgentLauncher(startup_timeout_s=self.opts.startup_timeout_s)
            self._launcher_start = asyncio.create_task(self.launcher.start(), name="launcher-start")
        if self.opts.tls:
            self._issue_certificates(started)
        elif self.opts.curve:
            self._issue_site_credentials(started)
        await self.start_etcd()
        assert self.store is not None
        diff = await apply_topology(self.store, self.initial_topology(), source=None if self.opts.joins else
                                    self.opts.topology.read_text(encoding="utf-8", errors="replace"))
        log.info("topology applied: %s", diff.summary() if hasattr(diff, "summary") else diff,
                 extra=kv(event="topology_apply"))
        self.blobs = BlobStore(self.host_home("ctl") / "blobs")  # the variant store's host holds the blobs
        self.catalog = Catalog(self.store)
        await ensure_digits_family(self.catalog, self.blobs)
        if self.opts.text_backbones is not None:
            await ensure_text_family(self.catalog, self.blobs, backbones=self.opts.text_backbones or None)
        if self.lab is not None:
            await self._start_control()
        else:
            store_site = self._store_site()
            tls = StoreTls(self.creds.pki.paths, STORE) if self.creds else None
            data = DataArea(self.blobs.root.parent / "data")
            self.data_quotas = DataQuotaFollower(self.store, data)
            await self.data_quotas.start()
            self.variant_server = VariantStoreServer(self.blobs, self.catalog, site=store_site, tls=tls, data=data)
            await self.variant_server.start()
            self.store_url = self.variant_server.url
            if self.opts.scheduler:
                sched_store = self.store
                if self.creds is not None:  # as its own etcd identity, so RBAC holds it to its role
                    sched_store = self._sched_store = await self._connect_as(SCHEDULER)
                data_ssl = None  # the leader's retention sweep reaches the data area as the scheduler
                if self.creds is not None:
                    f = self.creds.files(SCHEDULER)
                    data_ssl = ReloadingCredentials(Path(f["cert"]), Path(f["key"]), Path(f["ca"])).client_context()
                self.scheduler = Scheduler(sched_store, self.opts.scheduler_config(f"up-{os.getpid()}"),
                                           data_ssl=lambda: data_ssl)
                await self.scheduler.start()
        await self.start_crl_follow()
        if self.opts.console:
            await self._start_console()
        for name in names:
            # port 0: each agent binds its own (reserving ports here and releasing them raced with
            # the proxies' own listening ports); the proxies learn the real port when it is ready
            self.sites[name] = SiteProcess(name=name, zmq_port=0, extra_env=dict(self.opts.site_env.get(name, {})))
        if self.opts.wan:
            await self._start_proxies()
        if self._launcher_start is not None:
            await self._launcher_start
        await asyncio.gather(*(self.start_site(n) for n in started))

    async def _stop(self) -> None:
        try:
            for name in list(self.sites):
                with contextlib.suppress(Exception):
                    await self.kill_site(name, graceful=True)
            if self._launcher_start is not None:
                await cancel_and_wait(self._launcher_start)
            if self.launcher is not None:
                with contextlib.suppress(Exception):
                    await self.launcher.stop()
        finally:  # the sites' cgroups go even when a stop above failed
            if self.cgroups is not None:
                self.cgroups.close()
        await self.proxies.stop()
        for step in (self.console.stop if self.console else None, self.scheduler.stop if self.scheduler else None,
                     self.variant_server.stop if self.variant_server else None,
                     self.data_quotas.stop if self.data_quotas else None):
            if step is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(10):
                        await step()
        with contextlib.suppress(Exception):
            await self.stop_crl_follow()
        self.scheduler = None
        self.variant_server = None
        self.data_quotas = None
        self.console = None
        if self._sched_store is not None:
            with contextlib.suppress(Exception):
                await self._sched_store.close()
            self._sched_store = None
        try:
            if self.control is not None:
                await self.control.stop()
            await self.stop_etcd()
        finally:  # the namespaces go whatever happened above (the lab kills what still runs there)
            if self.lab is not None:
                await self.lab.stop()

    def _plan_caps(self, names: list[str]) -> None:
        """Each site's share of this machine, and a cgroup per site where cgroups are writable."""
        cpus = self.opts.machine_cpus or float(len(os.sched_getaffinity(0)))
        plan = plan_caps(self.topology, names, machine_cpus=cpus, machine_memory=machine_memory_mb())
        self.cgroups = CpuCgroups()
        how = f"cgroup {self.cgroups.version}" if self.cgroups.available else f"uncapped: {self.cgroups.why}"
        if not self.cgroups.available:
            log.warning("sites run without CPU caps: %s", self.cgroups.why, extra=kv(event="caps_unavailable"))
        self.site_caps = {n: replace(c, how=how, cpu=c.cpu if self.cgroups.available else None)
                          for n, c in plan.items()}

    def caps_report(self) -> dict[str, Any]:
        """What every site ran under (benchmarks record it beside their numbers)."""
        if not self.opts.caps:
            return {"capped": False, "why": "caps off (MeshOptions.caps)"}
        assert self.cgroups is not None
        return {"capped": self.cgroups.available, "why": self.cgroups.why,
                "machine_cpus": self.opts.machine_cpus or len(os.sched_getaffinity(0)),
                "sites": {n: c.to_json() for n, c in sorted(self.site_caps.items())}}

    async def _start_control(self) -> None:
        """The variant store and the scheduler as child processes on the ``ctl`` host, as deployed
        (:meth:`deployed_control`), plus the lab's scheduler knobs."""
        assert self.store is not None
        o = self.opts
        if any(getattr(o, k) is not None for k in ("forecast_horizon_s", "forecast_period_s", "forecast_bin_s",
                                                    "idle_evict_s", "min_residency_s")):
            raise ConfigError("with netns the scheduler runs as `tiermesh scheduler`: only interval_s, mode "
                              "and proactive can be set")
        store, sched, store_env, sched_env = self.deployed_control(f"up-{os.getpid()}")
        knobs = ["--mode", o.mode, *(["--interval", str(o.interval_s)] if o.interval_s is not None else []),
                 *([] if o.proactive else ["--reactive"])]
        extra = {"TIERMESH_LOG_LEVEL": o.agent_log_level, **o.agent_env}
        self.control = ControlProcesses(ControlOptions(
            logs=logs_dir(o.home), store=ControlCommand(list(store.args), store_env | extra),
            scheduler=ControlCommand([*sched.args, *knobs], sched_env | extra) if o.scheduler else None,
            exec_prefix=self._exec_prefix("ctl"), startup_timeout_s=o.startup_timeout_s), self.store)
        await self.control.start()
        self.store_url = self.control.store_url

    async def _start_console(self) -> None:
        assert self.store is not None
        if self.lab is not None:
            raise ConfigError("the console with netns is not built yet (the scheduler runs in the ctl namespace)")
        pki_dir = self.pki.paths.root if self.pki is not None else None
        # it runs in the scheduler's process: with RBAC, it reads etcd as the scheduler does
        store = self._sched_store or self.store
        self.console = ConsoleServer(store, ConsoleConfig(port=self.opts.console_port, pki_dir=pki_dir,
                                                          server_name=CONSOLE_SERVER.name,
                                                          scrape_admin=CONSOLE_SCRAPER.name,
                                                          token=None if pki_dir else new_token()),
                                    extra_routes=self._scheduler_routes())
        await self.console.start()

    def _scheduler_routes(self) -> list[Route]:
        """The in-process scheduler's Prometheus metrics at the console's ``/metrics`` (behind its admin gate)."""
        if self.scheduler is None:
            return []
        from core_scheduler.metrics import metrics_handler

        return [("GET", "/metrics", metrics_handler(self.scheduler.metrics.registry))]

    def addresses(self) -> dict[str, Any]:
        """What each participant listens on (for the report): per site its host address, HTTP URL
        and ZeroMQ endpoint (and namespace), plus etcd, the variant store and the proxies' address."""
        ns = (lambda role: self.lab.host(role).netns) if self.lab is not None else (lambda role: None)
        return {"etcd": self.etcd_url, "variant_store": self.store_url,
                "console": self.console.url if self.console is not None else None,
                "proxies": self.proxies.listen_host if self.opts.wan else None,
                "sites": {n: {"address": self._address(n), "http": sp.http, "zmq": sp.zmq, "netns": ns(n)}
                          for n, sp in sorted(self.sites.items())}}

    async def check_dial(self, url: str) -> None:
        """Before this (root-namespace) process dials ``url``: with netns, its host must be reached
        through the lab's bridge (``ip route get``), never by the default route."""
        host = urlsplit(url).hostname
        if self.lab is not None and host is not None:
            await self.lab.check_route(host)

    # -- etcd ------------------------------------------------------------------------------
    async def start_etcd(self) -> None:
        """Start etcd, or start it again after ``stop_etcd`` on the same ports and data dir: every
        process keeps its URL, and the kept Store reconnects (waited for here)."""
        if self.etcd is None and self.opts.etcd_members > 1:
            if self.lab is not None:
                raise ConfigError("an etcd cluster (etcd_members > 1) in network namespaces is not built yet")
            self.etcd = EtcdCluster(self.opts.home / "etcd", size=self.opts.etcd_members, tls=self.etcd_tls())
        elif self.etcd is None:
            data = self.host_home("etcd") / "data" if self.own_homes else self.opts.home / "etcd"
            kw: dict[str, Any] = {"data_dir": data, "host": self._address("etcd"),
                                  "client_port": self.etcd_port, "peer_port": self.etcd_peer_port,
                                  "tls": self.etcd_tls()}
            self.etcd = PrefixedEtcd(self._exec_prefix("etcd"), **kw) if self.lab else EmbeddedEtcd(**kw)
        await self.check_dial(self.etcd_url)
        await self.etcd.start()
        if self.store is None:
            self.store = await self._connect_as(OPERATOR)
            if self.creds is not None:  # idempotent: a kept home's etcd has it already
                await rbac.apply(self.store, rbac_plan(self.opts.prefix, self.topology.sites))
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

    async def _connect_as(self, who: Identity) -> Store:
        """A Store on this mesh's etcd, with ``who``'s client certificate when the mesh is secured."""
        if self.creds is None:
            return await Store.connect(self.etcd_url, self.opts.prefix)
        f = self.creds.files(who)
        return await Store.connect(self.etcd_url, self.opts.prefix, ca=f["ca"], cert=f["cert"], key=f["key"])

    def _store_site(self) -> str | None:
        if self.opts.store_site is not None:
            if self.opts.store_site not in self.topology.sites:
                raise ConfigError(f"store_site {self.opts.store_site!r} is not in {self.opts.topology}")
            return self.opts.store_site
        cores = sorted(n for n, s in self.topology.sites.items() if s.tier == "core")
        return cores[0] if cores else None

    # -- sites -----------------------------------------------------------------------------
    async def start_site(self, name: str) -> None:
        sp = self.sites[name]
        ready = self.opts.home / "sites" / name / "ready.json"
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.unlink(missing_ok=True)
        sp.log_path = site_log(self.opts.home, name)
        sp.log_path.parent.mkdir(parents=True, exist_ok=True)
        # what the lab adds to an agent's command line: plumbing (readiness, timing, the WAN emulation), never trust
        lab = ["--lease-ttl", str(self.opts.lease_ttl_s), "--ready-file", str(ready), "--routing-mode", self.opts.mode]
        if sp.peer_map_path is not None:
            lab += ["--peer-map", str(sp.peer_map_path)]
        if self.own_homes:  # as deployed: its own home and files, the manifests' command line and ports
            cmd, env = self.deployed_agent(name)
            cmd += lab
        else:
            cmd = [sys.executable, "-m", "tiermesh", "agent", "--site", name, "--etcd", self.etcd_url,
                   "--prefix", self.opts.prefix, "--home", str(self.opts.home), "--zmq-port", "0",
                   "--bind", self._address(name), *lab]
            if sp.http:  # a restart keeps the site's address: its callers' URLs stay good
                cmd += ["--http-port", str(urlsplit(sp.http).port)]
            if sp.grpc:
                cmd += ["--grpc-port", str(urlsplit(sp.grpc).port)]
            if self.opts.tls or self.opts.curve:
                cmd += ["--pki-dir", str(LocalPki.under(self.opts.home).paths.root)]
            if self.creds is not None:
                cmd += self.creds.etcd_args(Identity("site", name))
            if not self.opts.tls:
                cmd.append("--no-edge-tls" if self.opts.curve else "--insecure")
            env = dict(os.environ)
        caps = self.site_caps.get(name)
        prefix = self._exec_prefix(name)
        if caps is not None:
            cmd += ["--model-memory-mb", str(caps.model_memory_mb)]
            if caps.cpu is not None and self.cgroups is not None:
                self.cgroups.create(name, caps.cpu)
                # the cgroup first: `ip netns exec` keeps it (and remounts /sys, so the agent is told its cap too)
                prefix = [*self.cgroups.wrap(name), *prefix]
                cmd += ["--cpu-cap", f"{caps.cpu:.3f}"]
        env |= {"TIERMESH_LOG_LEVEL": self.opts.agent_log_level, **self.opts.agent_env, **sp.extra_env}
        if self.launcher is not None:  # cmd without `python -m tiermesh`; the child joins its cgroup first
            procs = self.cgroups.procs_file(name) if caps is not None and caps.cpu is not None and \
                self.cgroups is not None else None
            sp.proc = await self.launcher.spawn(cmd[3:], env=env, log_path=sp.log_path, cgroup_procs=procs)
        else:
            logf = sp.log_path.open("ab")
            try:
                sp.proc = await asyncio.create_subprocess_exec(*prefix, *cmd, stdout=logf, stderr=logf,
                                                               env=env, stdin=asyncio.subprocess.DEVNULL)
            finally:
                logf.close()  # the child holds its own descriptor
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while not ready.exists():
            if sp.proc.returncode is not None:
                raise MeshError(f"agent {name} exited with {sp.proc.returncode}; see {sp.log_path}:\n"
                                f"{_tail(sp.log_path)}")
            if time.monotonic() > deadline:
                raise MeshError(f"agent {name} not ready in {self.opts.startup_timeout_s:.0f} s; "
                                f"see {sp.log_path}")
            await asyncio.sleep(0.1)
        info = json.loads(ready.read_text())
        sp.http, sp.grpc, sp.zmq = info["http"], info.get("grpc"), info["zmq"]
        sp.zmq_port = int(str(info["zmq"]).rsplit(":", 1)[1])
        for (_, dst), proxy in self.proxies.proxies.items():
            if dst == name:
                proxy.set_upstream(self._address(name), sp.zmq_port)

    async def kill_site(self, name: str, *, graceful: bool = False) -> None:
        """SIGKILL (a crash: its lease must expire) or SIGTERM (a clean stop)."""
        sp = self.sites[name]
        proc, sp.proc = sp.proc, None
        if proc is not None:
            await terminate(proc, graceful=graceful)

    def edge_urls(self) -> dict[str, str]:
        return {n: sp.http for n, sp in self.sites.items()
                if sp.http and self.topology.sites[n].tier == "edge"}


def _tail(path: Path | None, lines: int = 12) -> str:
    """The last lines of a log (what a failed start said), for the error that reports it."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path is not None else ""
    except OSError:
        return ""
