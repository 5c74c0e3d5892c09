"""``tiermesh etcd``: run the embedded etcd in the foreground for a home directory (one member, or a local
cluster with ``--members 3``), so that other commands (and ``tiermesh up``) find it through
``<home>/etcd.json``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from mesh.errors import ConfigError
from mesh.etcd.cluster import EtcdCluster
from mesh.etcd.server import EmbeddedEtcd, clear_record, find_running, write_record
from mesh.settings import MeshSettings
from tiermesh.cli.main import EXIT_FAILED, EXIT_OK

__all__ = ["register", "run_etcd"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("etcd", help="run an embedded etcd in the foreground (Ctrl-C stops it)")
    p.add_argument("--home", metavar="DIR", default=None,
                   help="local state directory (default: $TIERMESH_HOME or ./.tiermesh)")
    p.add_argument("--port", type=int, default=None, help="client port (default: a free port; one member only)")
    p.add_argument("--members", type=int, default=1,
                   help="members of a local etcd cluster (default 1; 3 for failover tests), data under "
                        "<home>/etcd/m<i>")
    p.set_defaults(func=run_etcd)


async def run_etcd(args: argparse.Namespace) -> int:
    home = Path(args.home) if args.home else MeshSettings().home
    if args.members < 1:
        raise ConfigError(f"--members must be at least 1, not {args.members}")
    if args.members > 1 and args.port is not None:
        raise ConfigError("--port picks the port of a single member; a cluster's members pick free ports")
    running = find_running(home)
    if running:
        print(f"error: an etcd is already running for {home} at {running}", file=sys.stderr)
        return EXIT_FAILED
    server: EmbeddedEtcd | EtcdCluster = (EmbeddedEtcd(home / "etcd", client_port=args.port) if args.members == 1
                                          else EtcdCluster(home / "etcd", size=args.members))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        members = [server] if isinstance(server, EmbeddedEtcd) else server.members
        # a cluster is recorded under this process (it lives as long as we do), one member under its own
        pid = server.pid if isinstance(server, EmbeddedEtcd) else os.getpid()
        assert pid is not None
        write_record(home, pid, server.url)
        print(server.url, flush=True)
        logs = ", ".join(str(m.log_path) for m in members)
        print(f"etcd data in {home / 'etcd'}, log {logs}; Ctrl-C to stop", file=sys.stderr, flush=True)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            dead = [m for m in members if not m.running()]
            if dead:
                print(f"error: etcd exited; see {dead[0].log_path}", file=sys.stderr)
                return EXIT_FAILED
        return EXIT_OK
    finally:
        clear_record(home)
        await server.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
