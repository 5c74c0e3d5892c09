"""The control services as child processes: the variant store (``tiermesh variants serve``) and a
scheduler replica (``tiermesh scheduler``), started with a command prefix such as
``ip netns exec NS`` so they run on a host of their own (``tiermesh up --netns``), with the command lines
and settings the deployed hosts use (:mod:`tiermesh.hosts`, via :mod:`tiermesh.lab_hosts`).

:class:`ControlProcesses` starts the store, waits until its announcement in etcd is its own (the
pid matches: a stale record of an earlier run does not count), then the scheduler; it stops them
in reverse order, SIGKILL after a grace period, even after a failed start.
"""

from __future__ import annotations

import asyncio
import contextlib
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

__all__ = ["ControlCommand", "ControlOptions", "ControlProcesses", "PrefixedEtcd", "terminate"]


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
class ControlCommand:
    """One control process: ``python -m tiermesh <args>`` with exactly ``env``."""

    args: list[str]
    env: dict[str, str]


@dataclass(slots=True)
class ControlOptions:
    logs: Path                             # where each process's log goes (<logs>/<name>.log)
    store: ControlCommand                  # the variant store (``tiermesh variants serve ...``)
    scheduler: ControlCommand | None = None
    exec_prefix: list[str] = field(default_factory=list)
    startup_timeout_s: float = 90.0


class ControlProcesses(Service):
    def __init__(self, opts: ControlOptions, store: Store) -> None:
        self.opts = opts
        self.store = store
        self.store_url: str | None = None
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    async def _start(self) -> None:
        o = self.opts
        proc = await self._spawn("variant-store", o.store)
        deadline = time.monotonic() + o.startup_timeout_s
        while (rec := await self.store.get(blobs_key())) is None or rec.value.get("pid") != proc.pid:
            if proc.returncode is not None or time.monotonic() > deadline:
                raise MeshError(f"the variant store did not announce itself; see {self._log('variant-store')}")
            await asyncio.sleep(0.1)
        self.store_url = str(rec.value["url"])
        if o.scheduler is not None:
            await self._spawn("scheduler", o.scheduler)

    async def _stop(self) -> None:
        for name in reversed(list(self.procs)):
            await terminate(self.procs.pop(name))

    def _log(self, name: str) -> Path:
        return self.opts.logs / f"{name}.log"

    async def _spawn(self, name: str, command: ControlCommand) -> asyncio.subprocess.Process:
        path = self._log(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as logf:  # the child keeps its own descriptor
            proc = await asyncio.create_subprocess_exec(
                *self.opts.exec_prefix, sys.executable, "-m", "tiermesh", *command.args, stdout=logf, stderr=logf,
                env=command.env, stdin=asyncio.subprocess.DEVNULL)
        self.procs[name] = proc
        return proc
