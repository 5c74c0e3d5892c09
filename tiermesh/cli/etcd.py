"""``tiermesh etcd``: run the embedded etcd in the foreground for a home directory, so that other
commands (and ``tiermesh up``) find it through ``<home>/etcd.json``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from mesh.etcd.server import EmbeddedEtcd, clear_record, find_running, write_record
from mesh.settings import MeshSettings
from tiermesh.cli.main import EXIT_FAILED, EXIT_OK

__all__ = ["register", "run_etcd"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("etcd", help="run an embedded etcd in the foreground (Ctrl-C stops it)")
    p.add_argument("--home", metavar="DIR", default=None,
                   help="local state directory (default: $TIERMESH_HOME or ./.tiermesh)")
    p.add_argument("--port", type=int, default=None, help="client port (default: a free port)")
    p.set_defaults(func=run_etcd)


async def run_etcd(args: argparse.Namespace) -> int:
    home = Path(args.home) if args.home else MeshSettings().home
    running = find_running(home)
    if running:
        print(f"error: an etcd is already running for {home} at {running}", file=sys.stderr)
        return EXIT_FAILED
    server = EmbeddedEtcd(home / "etcd", client_port=args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        assert server.pid is not None
        write_record(home, server.pid, server.url)
        print(server.url, flush=True)
        print(f"etcd data in {server.data_dir}, log {server.log_path}; Ctrl-C to stop", file=sys.stderr,
              flush=True)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if not server.running():
                print(f"error: etcd exited; see {server.log_path}", file=sys.stderr)
                return EXIT_FAILED
        return EXIT_OK
    finally:
        clear_record(home)
        await server.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
