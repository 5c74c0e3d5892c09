"""What a local mesh is asked to be (:class:`MeshOptions`), what it keeps per site process
(:class:`SiteProcess`), and the shape of each site-to-site path its delay proxies give (:func:`path_shape`).
:class:`tiermesh.harness.LocalMesh` stands on these."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path

from core_scheduler.scheduler import SchedulerConfig
from tiermesh.delayproxy import LinkShape
from tiermesh.launcher import ForkedChild
from topology.paths import topology_paths
from topology.schema import Topology

__all__ = ["MeshOptions", "SiteProcess", "free_port", "logs_dir", "path_shape", "site_log"]


def logs_dir(home: Path) -> Path:
    """Where a local mesh's component logs go: one per site agent (:func:`site_log`), the control processes'
    with netns (``variant-store.log``, ``scheduler.log``) and ``tiermesh up``'s own (``up.log``)."""
    return home / "logs"


def site_log(home: Path, site: str) -> Path:
    """A site agent's log (its stdout and stderr: JSON records, and whatever its libraries print)."""
    return logs_dir(home) / f"{site}.log"


def free_port() -> int:
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
    # sites that are not there at start (their links neither): each joins when join_site() is called, as an
    # operator adds a machine (tiermesh.lab_hosts); with netns its namespace exists from the start, empty
    joins: list[str] = field(default_factory=list)
    agent_log_level: str = "WARNING"
    startup_timeout_s: float = 90.0
    mode: str = "tiermesh"          # routing + placement mode (baselines for benchmarks)
    proactive: bool = True           # scheduler forecasts demand and prewarms
    agent_env: dict[str, str] = field(default_factory=dict)  # extra environment of every agent
    site_env: dict[str, dict[str, str]] = field(default_factory=dict)  # ... and of one site's agent
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
    netns: bool = False              # every participant in its own network namespace (root)
    tls: bool = False                # edge APIs over mutual TLS, certificates issued into home/pki
    # CURVE between sites: a CA in <home>/pki (made if missing) and a certificate + CURVE key per site
    curve: bool = False
    # each agent gets the CPU (a cgroup quota) and model memory its topology entry declares, scaled to this
    # machine (:mod:`tiermesh.caps`); where cgroups are not writable the sites run uncapped and say so
    caps: bool = False
    machine_cpus: float | None = None   # with caps: the cores to share out (None: this process's CPUs)
    # the text family's encoders (None: none; else the backbones, [] meaning all): built once into a
    # cache (``variant_store.build_text``), so off by default for tests that serve digits only
    text_backbones: list[str] | None = None
    console: bool = False            # the admin console beside the scheduler (not with netns yet)
    console_port: int = 0            # 0: any free port (LocalMesh.console.url says which)
    # agents forked from one launcher that imported their code once (tiermesh.launcher), rather than one fresh
    # interpreter each; never with netns (a child would have to enter its namespace)
    fork_agents: bool = True

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
    proc: asyncio.subprocess.Process | ForkedChild | None = None
    http: str | None = None
    grpc: str | None = None          # its gRPC front's URL (grpc:// or grpcs://), None when off
    zmq: str | None = None           # the endpoint it advertises
    log_path: Path | None = None
    peer_map_path: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
