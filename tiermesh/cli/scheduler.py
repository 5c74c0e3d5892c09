"""``tiermesh scheduler``: run a scheduler replica (one of several; one leads via etcd election)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket

from core_scheduler.scheduler import Scheduler, SchedulerConfig
from mesh.log import get_logger, kv
from mesh.settings import MeshSettings
from tiermesh.cli.context import open_store, store_args

__all__ = ["register"]

log = get_logger(__name__)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from tiermesh.cli.main import add_addresses, add_common

    p = sub.add_parser("scheduler", help="run a scheduler replica (placement control loop)",
                       description="Run a scheduler replica. Replicas elect one leader through etcd; the leader "
                                   "decides which variants each site holds and writes placement/<site>.")
    add_common(p)
    p.add_argument("--id", default=f"{socket.gethostname()}-{os.getpid()}", help="candidate id")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between placement rounds")
    p.add_argument("--reactive", action="store_true", help="no demand forecast (reactive placement only)")
    p.add_argument("--election-ttl", type=float, default=3.0,
                   help="lease TTL of the election key, seconds: a dead leader is replaced within it")
    p.add_argument("--mode", default="tiermesh", help="placement mode (tiermesh or a baseline)")
    add_addresses(p, "the admin console", note=". Recorded only: the scheduler serves nothing yet")
    p.set_defaults(func=_run)


async def _run(args: argparse.Namespace) -> int:
    settings = MeshSettings()
    # checked now (a wildcard without --advertise is refused) so the console inherits valid values
    args.bind = args.bind or settings.bind
    args.advertise = settings.advertised_host(args.bind, args.advertise)
    log.info("scheduler %s: console address recorded (bind %s, advertise %s); nothing served yet",
             args.id, args.bind, args.advertise, extra=kv(event="scheduler_addresses"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with open_store(**store_args(args)) as store:
        sched = Scheduler(store, SchedulerConfig(candidate_id=args.id, interval_s=args.interval,
                                                 election_ttl_s=args.election_ttl, mode=args.mode,
                                                 proactive=not args.reactive))
        await sched.start()
        try:
            await stop.wait()
        finally:
            await sched.stop()
    return 0
