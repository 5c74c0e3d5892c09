"""What an agent is told at start (``tiermesh agent``'s flags, or a harness): :class:`AgentConfig`.
Re-exported by :mod:`edge_agent.agent`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.device_memory import DEFAULT_DEVICE_FRACTION
from edge_agent.http_api import DEFAULT_MAX_BODY
from mesh.addresses import DEFAULT_BIND
from mesh.errors import ConfigError

__all__ = ["BLOB_PEER", "AgentConfig"]

# Peer-map key of the variant store (not a site: '@' is not allowed in site names). With WAN
# emulation the harness maps it to a delay proxy, so blob fetches travel the site's real path.
BLOB_PEER = "@variant-store"


@dataclass(slots=True)
class AgentConfig:
    site: str
    etcd: str                          # member URLs, comma-separated
    etcd_ca: Path | None = None        # TLS to etcd (https:// URLs): CA, client certificate and key
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    prefix: str = "/tiermesh/"
    home: Path = Path(".tiermesh")
    http_port: int = 0
    grpc_port: int | None = 0         # the gRPC Open Inference Protocol front (0: a free port; None: none)
    zmq_port: int = 0
    bind: str = DEFAULT_BIND          # address HTTP, gRPC and ZeroMQ listen on (0.0.0.0 / ::: every interface)
    advertise: str | None = None      # what peers dial (live record); None: the bind address
    peer_map: dict[str, str] = field(default_factory=dict)  # site -> endpoint (WAN emulation proxies);
    # BLOB_PEER -> the variant store's URL as this site reaches it
    lease_ttl_s: float = 3.0
    heartbeat_s: float = 1.0          # how often the live record is looked at (written when it has news)
    # the view follows the heartbeats of the route_peers nearest sites and the route_per_tier nearest of
    # each tier (core_scheduler.state.scope); a mesh of at most route_peers + 1 sites is followed whole
    route_peers: int = 48
    route_per_tier: int = 2
    idle_unload_s: float = 120.0
    demand_window_s: float = 10.0     # demand reported per task and SLO class, averaged over this
    model_memory_fraction: float = 0.25  # share of the site's memory its models may take
    model_memory_mb: int | None = None   # ... or this budget (a harness scaling sites to one machine)
    # share of the device memory (the topology's GPUs, scaled to the device present) models may take
    # (edge_agent.device_memory: the rest is the CUDA context, workspaces, allocator slack)
    device_memory_fraction: float = DEFAULT_DEVICE_FRACTION
    device_memory_mb: int | None = None  # a device of this size stands in for the one detected (tests, harnesses)
    # the CPU cap (cores) its launcher set: used only when the agent cannot read its own cgroup
    cpu_cap: float | None = None
    routing_mode: str = "tiermesh"      # or a baseline (core_scheduler.policy.modes), for benchmarks
    max_body_bytes: int = DEFAULT_MAX_BODY  # largest request body (HTTP) and tensor payload (ZeroMQ)
    # the edge HTTP API over mutual TLS with the site's certificate from home/pki (`tiermesh agent` turns it
    # on unless --insecure); False: plain HTTP, the tenant taken from a header (development only)
    tls: bool = False
    # the PKI directory of both (None: <home>/pki). CURVE between sites is always on: this site's certificate
    # and CURVE key must be there, or the agent refuses to start (fail closed). ``insecure`` is the only way to
    # plain ZeroMQ (with a warning), and cannot be combined with ``tls``.
    pki_dir: Path | None = None
    insecure: bool = False
    # decision traces: the share of queries traced without asking (0: only those that ask, with
    # parameters.trace), and how many traces this door keeps for GET /v2/traces/{request_id}
    trace_sample_rate: float = 0.01
    trace_buffer: int = 1000

    def __post_init__(self) -> None:
        if self.insecure and self.tls:  # an edge that checks certificates beside site links that check nothing
            raise ConfigError("an agent with edge TLS runs CURVE between sites: drop insecure, or tls")
