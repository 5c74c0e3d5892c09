"""A CPU cap on one process for a while: a cgroup of its own with a CFS quota (v1 ``cpu`` controller, or
v2 ``cpu.max``), or where neither is writable, SIGSTOP/SIGCONT bursts. Released (the process moved back
to the root group, the group removed) by ``release``, which the owner calls whatever happened."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

from mesh.log import get_logger, kv

__all__ = ["CpuCap"]

log = get_logger(__name__)
V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
BURST_PERIOD_S = 0.1  # SIGSTOP fallback: stopped for (1 - share) of each period


class CpuCap:
    def __init__(self, name: str, share: float, *, v1_root: Path = V1, v2_root: Path = V2) -> None:
        self.name = name
        self.share = share
        self._v1, self._v2 = v1_root, v2_root
        self.group: Path | None = None
        self._pid: int | None = None
        self._bursts: asyncio.Task[None] | None = None

    async def hold(self, pid: int) -> str:
        """Cap ``pid``; returns how (``cgroup-v1``, ``cgroup-v2`` or ``sigstop``)."""
        self._pid = pid
        for how, root, setup in (("cgroup-v1", self._v1, self._setup_v1), ("cgroup-v2", self._v2, self._setup_v2)):
            group = root / self.name
            try:
                group.mkdir()
            except OSError:
                continue
            self.group = group
            try:
                setup(group)
                # every thread: cgroup.procs moves the whole process
                (group / "cgroup.procs").write_text(str(pid))
                return how
            except OSError as exc:
                log.info("cannot cap through %s: %s", group, exc, extra=kv(event="cpu_cap"))
                self._remove_group()
        self._bursts = asyncio.create_task(self._stop_bursts(pid), name=f"cpu-cap:{pid}")
        return "sigstop"

    def _setup_v1(self, group: Path) -> None:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(PERIOD_US * self.share))))

    def _setup_v2(self, group: Path) -> None:
        if not (group / "cpu.max").exists():
            raise OSError("no cpu controller in this cgroup v2 group")
        (group / "cpu.max").write_text(f"{max(1000, int(PERIOD_US * self.share))} {PERIOD_US}")

    async def _stop_bursts(self, pid: int) -> None:
        try:
            while True:
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(BURST_PERIOD_S * (1 - self.share))
                os.kill(pid, signal.SIGCONT)
                await asyncio.sleep(BURST_PERIOD_S * self.share)
        except ProcessLookupError:
            return
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _remove_group(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        # a group can only be removed empty: move whatever is in it back to the root first
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (group.parent / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            group.rmdir()

    async def release(self) -> None:
        if self._bursts is not None:
            self._bursts.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._bursts
            self._bursts = None
        self._remove_group()

    @property
    def released(self) -> bool:
        return self.group is None and self._bursts is None
