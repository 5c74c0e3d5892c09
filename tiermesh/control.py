"""The control services as child processes: the variant store (``tiermesh variants serve``) and a
scheduler replica (``tiermesh scheduler``), started with a command prefix such as
``ip netns exec NS`` so they run on a host of their own (``tiermesh up --netns``).

:class:`ControlProcesses` starts the store, waits until its announcement in etcd is its own (the
pid matches: a stale record of an earlier run does not count), then the scheduler; it stops them
in reverse order, SIGKILL after a grace period, even after a failed start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mesh.errors import MeshError
from mesh.etcd.keys import blobs_key
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.lifecycle import Service
from tiermesh.launcher import ForkedChild

__all__ = ["ControlOptions", "ControlProcesses", "PrefixedEtcd", "terminate"]


async def terminate(proc: asyncio.subprocess.Process | ForkedChild, *, graceful: bool = True,
                    grace_s: float = 15.0) -> None:
    """SIGTERM (or SIGKILL) a child and reap it; SIGKILL once ``grace_s`` has passed."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
    try:
        async with asyncio.timeout(grace_s):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


class PrefixedEtcd(EmbeddedEtcd):
    """The embedded etcd started behind a command prefix (``ip netns exec NS`` execs, so the child's
    pid, log and shutdown are those of etcd itself)."""

    def __init__(self, exec_prefix: list[str], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._exec_prefix = list(exec_prefix)

    def _command(self) -> list[str]:
        return [*self._exec_prefix, *super()._command()]


@dataclass(slots=True)
class ControlOptions:
    etcd_url: str
    prefix: str
    home: Path
    bind: str                              # the address both listen on (the console's, later)
    exec_prefix: list[str] = field(default_factory=list)
    store_site: str | None = None
    scheduler: bool = True
    scheduler_id: str = ""
    mode: str = "tiermesh"
    interval_s: float | None = None
    proactive: bool = True
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 90.0
    store_args: list[str] = field(default_factory=list)      # the variant store's etcd and HTTPS credentials
    scheduler_args: list[str] = field(default_factory=list)  # the scheduler's etcd credentials


class ControlProcesses(Service):
    def __init__(self, opts: ControlOptions, store: Store) -> None:
        self.opts = opts
        self.store = store
        self.store_url: str | None = None
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    async def _start(self) -> None:
        o = self.opts
        common = ["--etcd", o.etcd_url, "--prefix", o.prefix, "--home", str(o.home), "--bind", o.bind]
        serve = ["variants", "serve", *common, "--port", "0", *o.store_args]
        serve += ["--site", o.store_site] if o.store_site else []
        proc = await self._spawn("variant-store", serve)
        deadline = time.monotonic() + o.startup_timeout_s
        while (rec := await self.store.get(blobs_key())) is None or rec.value.get("pid") != proc.pid:
            if proc.returncode is not None or time.monotonic() > deadline:
                raise MeshError(f"the variant store did not announce itself; see {self._log('variant-store')}")
            await asyncio.sleep(0.1)
        self.store_url = str(rec.value["url"])
        if o.scheduler:
            sched = ["scheduler", *common, *o.scheduler_args, "--id", o.scheduler_id or f"up-{os.getpid()}",
                     "--mode", o.mode]
            sched += ["--interval", str(o.interval_s)] if o.interval_s is not None else []
            sched += [] if o.proactive else ["--reactive"]
            await self._spawn("scheduler", sched)

    async def _stop(self) -> None:
        for name in reversed(list(self.procs)):
            await terminate(self.procs.pop(name))

    def _log(self, name: str) -> Path:
        return self.opts.home / "ctl" / f"{name}.log"

    async def _spawn(self, name: str, args: list[str]) -> asyncio.subprocess.Process:
        path = self._log(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as logf:  # the child keeps its own descriptor
            proc = await asyncio.create_subprocess_exec(
                *self.opts.exec_prefix, sys.executable, "-m", "tiermesh", *args, stdout=logf, stderr=logf,
                env={**os.environ, **self.opts.env}, stdin=asyncio.subprocess.DEVNULL)
        self.procs[name] = proc
        return proc
