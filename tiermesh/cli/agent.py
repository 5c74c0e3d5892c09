"""``tiermesh agent --site NAME``: run one site agent in the foreground until SIGINT/SIGTERM.

``tiermesh agent --site NAME --http-port PORT --probe`` instead asks that site's running agent whether it is
ready, over mutual TLS with the site's own certificate (Kubernetes' ``httpGet`` probes cannot present one).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import signal
import ssl
import sys
from pathlib import Path

from edge_agent.agent import Agent, load_peer_map
from edge_agent.agent_config import AgentConfig
from mesh.errors import ConfigError
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.settings import MeshSettings

__all__ = ["INSECURE_WARNING", "agent_config", "probe_ready", "register", "run_agent"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from tiermesh.cli.main import add_addresses, add_common

    p = sub.add_parser("agent", help="run a site agent (any tier)",
                       description="Run the site agent for SITE: hosts variants, routes queries, serves the "
                                   "edge HTTP API (Open Inference Protocol) and the site-to-site ZeroMQ port, "
                                   "and heartbeats into etcd. Tier and hardware come from the topology in etcd.")
    add_common(p)
    p.add_argument("--site", required=True, help="site name from the topology")
    add_addresses(p, "the edge HTTP API and the ZeroMQ port")
    p.add_argument("--http-port", type=int, default=0, help="edge HTTP port (0: pick a free one)")
    p.add_argument("--grpc-port", type=int, default=0,
                   help="edge gRPC port: the Open Inference Protocol over gRPC, as tritonclient.grpc calls it, with "
                        "the HTTP API's TLS and tenants (0: pick a free one; -1: no gRPC front)")
    p.add_argument("--zmq-port", type=int, default=0, help="site-to-site ZeroMQ port (0: pick a free one)")
    p.add_argument("--peer-map", type=Path, default=None,
                   help="JSON {site: tcp://host:port} overriding peers' endpoints (WAN emulation proxies)")
    p.add_argument("--lease-ttl", type=float, default=3.0, help="liveness lease TTL in seconds")
    p.add_argument("--routing-mode", default="tiermesh",
                   help="tiermesh (default) or a baseline policy for benchmarks: edge-only, core-only, static, infaas")
    p.add_argument("--pki-dir", type=Path, default=None,
                   help="PKI directory holding ca.pem and sites/SITE.pem, SITE-key.pem, SITE.curve (default "
                        "HOME/pki): the edge API's certificate, and the CURVE keys site-to-site links use to admit "
                        "only sites with valid certificates")
    p.add_argument("--insecure", action="store_true",
                   help="development only (prints a warning): the edge API over plain HTTP with the tenant taken "
                        "from the X-Tiermesh-Tenant header (anyone can claim any tenant), and no CURVE between "
                        "sites. Default: HTTPS with client certificates, CURVE between sites")
    p.add_argument("--no-edge-tls", action="store_true",
                   help="the edge API over plain HTTP (tenant from the header) while site-to-site links keep "
                        "CURVE: for an agent behind a TLS-terminating proxy that sets the header, and for tests")
    p.add_argument("--cpu-cap", type=float, default=None, metavar="CORES",
                   help="the CPU cap the launcher set for this agent (cores), used when the agent cannot read its "
                        "own cgroup (in a network namespace /sys is remounted); its hardware class names the cap")
    p.add_argument("--model-memory-mb", type=int, default=None, metavar="MIB",
                   help="model-memory budget this agent enforces (default: a share of the site's declared memory)")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write {http, grpc, zmq} here once serving (for harnesses; grpc null when off)")
    p.add_argument("--probe", action="store_true",
                   help="do not run an agent: ask SITE's running agent on --http-port (at --bind, default "
                        "127.0.0.1) for /v2/health/ready over mutual TLS with the site's own certificate, and exit "
                        "0 if it is ready, 1 if not (a Kubernetes exec readiness probe)")
    p.set_defaults(func=run_agent)


def agent_config(args: argparse.Namespace, settings: MeshSettings) -> AgentConfig:
    """The agent's configuration from its command line, then settings (``TIERMESH_*``), then defaults."""
    from tiermesh.cli.context import etcd_endpoints

    ca, cert, key = (_path(getattr(args, f"etcd_{name}", None) or getattr(settings, f"etcd_{name}"))
                     for name in ("ca", "cert", "key"))
    endpoints = etcd_endpoints(args.etcd, ca, cert, key, settings)  # ConfigError for bad URLs or files
    etcd = str(endpoints) if endpoints is not None else None
    if not etcd:
        from mesh.etcd.server import running_record

        home = Path(args.home) if args.home else settings.home
        running = running_record(home)
        if running is None:
            raise ConfigError("no etcd: pass --etcd URL or start one with `tiermesh etcd` / `tiermesh up`")
        etcd = running.url
        if running.ca is not None and cert is None:  # a secured local etcd: as this site, from its PKI dir
            paths = PkiPaths(args.pki_dir) if getattr(args, "pki_dir", None) else PkiPaths.under(home)
            me = Identity("site", args.site)
            ca, cert, key = paths.ca_cert, paths.cert(me), paths.key(me)
    bind, advertise = getattr(args, "bind", None), getattr(args, "advertise", None)
    return AgentConfig(site=args.site, etcd=etcd, etcd_ca=ca, etcd_cert=cert, etcd_key=key,
                       prefix=args.prefix or settings.prefix,
                       home=Path(args.home) if args.home else settings.home, http_port=args.http_port,
                       grpc_port=_grpc_port(getattr(args, "grpc_port", 0)),
                       zmq_port=args.zmq_port, bind=bind or settings.bind,
                       advertise=settings.advertised_host(bind, advertise),
                       peer_map=load_peer_map(args.peer_map),
                       lease_ttl_s=args.lease_ttl, routing_mode=args.routing_mode,
                       idle_unload_s=settings.agent_idle_unload_s,
                       demand_window_s=settings.agent_demand_window_s, max_body_bytes=settings.max_body_bytes,
                       trace_sample_rate=settings.agent_trace_sample_rate,
                       trace_buffer=settings.agent_trace_buffer,
                       tls=not (getattr(args, "insecure", False) or getattr(args, "no_edge_tls", False)),
                       pki_dir=getattr(args, "pki_dir", None), insecure=bool(getattr(args, "insecure", False)),
                       cpu_cap=getattr(args, "cpu_cap", None),
                       model_memory_mb=getattr(args, "model_memory_mb", None))


INSECURE_WARNING = ("WARNING: --insecure: the edge API speaks plain HTTP and believes the X-Tiermesh-Tenant "
                    "header; any caller can claim any tenant; site-to-site links are not authenticated. "
                    "For development only.")


def _grpc_port(port: int) -> int | None:
    if port < -1 or port > 65535:
        raise ConfigError(f"--grpc-port must be a port, 0 (a free one) or -1 (no gRPC front), not {port}")
    return None if port == -1 else port


def _path(value: str | Path | None) -> Path | None:
    return Path(value) if value else None


def probe_ready(home: Path, site: str, port: int, *, host: str = "127.0.0.1", tls: bool = True,
                timeout_s: float = 5.0) -> tuple[bool, str]:
    """(ready?, why) from ``GET /v2/health/ready`` on ``host:port``. With ``tls`` the client presents the site's
    certificate from ``home/pki`` (the health endpoints admit any valid identity) and requires the server to
    prove that same site identity: we dial ourselves by a local address, which no certificate names, so the
    check is on the identity rather than the host name."""
    if not 0 < port < 65536:
        raise ConfigError(f"--probe needs the agent's --http-port (1-65535), not {port}")
    conn: http.client.HTTPConnection
    paths, identity = PkiPaths.under(home), Identity("site", site)
    if tls:
        try:
            ctx = ssl.create_default_context(cafile=str(paths.ca_cert))
            ctx.check_hostname = False  # verify_mode stays CERT_REQUIRED: the chain is checked, then the SAN
            ctx.load_cert_chain(paths.cert(identity), paths.key(identity))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"--probe: cannot load site {site}'s credentials under {paths.root}: {exc}") from exc
        conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=timeout_s)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.connect()
        if isinstance(conn.sock, ssl.SSLSocket):
            sans = (conn.sock.getpeercert() or {}).get("subjectAltName", ())
            if ("URI", identity.uri) not in sans:
                return False, f"the server at {host}:{port} is not {identity.uri} (SANs {list(sans)})"
        conn.request("GET", "/v2/health/ready")
        resp = conn.getresponse()
        body = resp.read(4096).decode("utf-8", "replace")
    except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
        return False, f"{host}:{port}: {type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return resp.status == 200, f"{resp.status} {body.strip()}"


async def run_agent(args: argparse.Namespace) -> int:
    if getattr(args, "probe", False):
        settings = MeshSettings()
        home = Path(args.home) if args.home else settings.home
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(args.bind, args.bind) if args.bind else "127.0.0.1"
        ok, why = await asyncio.to_thread(probe_ready, home, args.site, args.http_port, host=host,
                                          tls=not args.insecure)
        print(f"agent {args.site}: {'ready' if ok else 'not ready'}: {why}", file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    cfg = agent_config(args, MeshSettings())
    if not cfg.tls:
        print(INSECURE_WARNING, file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Agent(cfg) as agent:
        if args.ready_file is not None:
            import json

            tmp = args.ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"http": agent.http_url, "grpc": agent.grpc_url, "zmq": agent.zmq_endpoint}))
            tmp.rename(args.ready_file)
        print(f"agent {args.site} serving: http {agent.http_url} grpc {agent.grpc_url or 'off'} "
              f"zmq {agent.zmq_endpoint}", flush=True)
        await stop.wait()
    return 0
