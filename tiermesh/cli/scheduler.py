"""``tiermesh scheduler``: run a scheduler replica (one of several; one leads via etcd election), and with
``--console-port`` the admin console beside it (every replica can serve it: it reads etcd, not the leader)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import ssl
import sys
from collections.abc import Callable
from pathlib import Path

from console import ConsoleConfig, ConsoleServer
from console.app import Route
from core_scheduler.scheduler import Scheduler, SchedulerConfig
from mesh.errors import ConfigError
from mesh.log import get_logger, kv
from mesh.pki.reload import ReloadingCredentials
from mesh.settings import MeshSettings
from tiermesh.cli.context import open_store, store_args

__all__ = ["register", "scheduler_routes"]

log = get_logger(__name__)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from tiermesh.cli.main import add_addresses, add_common

    p = sub.add_parser("scheduler", help="run a scheduler replica (placement control loop) and the admin console",
                       description="Run a scheduler replica. Replicas elect one leader through etcd; the leader "
                                   "decides which variants each site holds and writes placement/<site>. With "
                                   "--console-port the replica also serves the admin console (HTTPS, admin client "
                                   "certificates only; --insecure: plain HTTP with a token).")
    add_common(p)
    p.add_argument("--id", default=f"{socket.gethostname()}-{os.getpid()}", help="candidate id")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between placement rounds")
    p.add_argument("--reactive", action="store_true", help="no demand forecast (reactive placement only)")
    p.add_argument("--election-ttl", type=float, default=3.0,
                   help="lease TTL of the election key, seconds: a dead leader is replaced within it")
    p.add_argument("--mode", default="tiermesh", help="placement mode (tiermesh or a baseline)")
    add_addresses(p, "the admin console", aliases=("--console-bind",))
    p.add_argument("--console-port", type=int, default=None, metavar="PORT",
                   help="serve the admin console on this port (0: any free one; default: no console)")
    p.add_argument("--pki-dir", type=Path, default=None,
                   help="the mesh PKI (default HOME/pki): the console serves as scheduler/NAME (--console-name) "
                        "and scrapes the agents as admin/NAME (--console-admin)")
    p.add_argument("--console-name", default="console", help="scheduler identity the console serves as")
    p.add_argument("--console-admin", default="console", help="admin identity the console scrapes agents as")
    p.add_argument("--insecure", action="store_true",
                   help="console over plain HTTP with a token instead of client certificates (development only; "
                        "the token is $TIERMESH_CONSOLE_TOKEN or a fresh one, printed on stderr)")
    p.set_defaults(func=_run)


def scheduler_routes(sched: Scheduler) -> list[Route]:
    """Routes the console serves for the scheduler process itself, behind the same admin gate: the
    scheduler's Prometheus metrics at ``/metrics``."""
    from core_scheduler.metrics import metrics_handler

    return [("GET", "/metrics", metrics_handler(sched.metrics.registry))]


def _console_config(args: argparse.Namespace, settings: MeshSettings) -> ConsoleConfig | None:
    if args.console_port is None:
        return None
    if not 0 <= args.console_port <= 65535:
        raise ConfigError(f"--console-port {args.console_port}: a port is 0..65535")
    if args.insecure:
        token = settings.console_token or None
        return ConsoleConfig(bind=args.bind, port=args.console_port, advertise=args.advertise, token=token)
    home = Path(args.home) if args.home else settings.home
    return ConsoleConfig(bind=args.bind, port=args.console_port, advertise=args.advertise,
                         pki_dir=args.pki_dir or home / "pki", server_name=args.console_name,
                         scrape_admin=args.console_admin)


def _data_ssl(args: argparse.Namespace, settings: MeshSettings) -> Callable[[], ssl.SSLContext | None]:
    """The client context of the leader's retention sweep on the variant store's data area: the scheduler's etcd
    client certificate (the mesh CA's ``scheduler:<N>``, which the store accepts) when one is given."""
    cert = getattr(args, "etcd_cert", None) or settings.etcd_cert
    key = getattr(args, "etcd_key", None) or settings.etcd_key
    ca = getattr(args, "etcd_ca", None) or settings.etcd_ca
    if not (cert and key and ca):
        return lambda: None
    ctx = ReloadingCredentials(Path(cert), Path(key), Path(ca)).client_context()
    return lambda: ctx


async def _run(args: argparse.Namespace) -> int:
    settings = MeshSettings()
    # checked now (a wildcard without --advertise is refused) so the console inherits valid values
    args.bind = args.bind or settings.bind
    args.advertise = settings.advertised_host(args.bind, args.advertise)
    console_cfg = _console_config(args, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with open_store(**store_args(args)) as store:
        sched = Scheduler(store, SchedulerConfig(candidate_id=args.id, interval_s=args.interval,
                                                 election_ttl_s=args.election_ttl, mode=args.mode,
                                                 proactive=not args.reactive), data_ssl=_data_ssl(args, settings))
        console = ConsoleServer(store, console_cfg, extra_routes=scheduler_routes(sched)) if console_cfg else None
        await sched.start()
        try:
            if console is not None:
                await console.start()
                log.info("scheduler %s: console at %s", args.id, console.url, extra=kv(event="console_up"))
                print(f"console {console.login_url}", file=sys.stderr, flush=True)
            await stop.wait()
        finally:
            if console is not None:
                await console.stop()
            await sched.stop()
    return 0
