"""The chaos suite's slow site: a busy child held to a tenth of a core (cgroup quota where writable, else
SIGSTOP bursts) uses about that much CPU, and releasing the cap leaves no cgroup behind."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from tiermesh.chaos.cgroup import CpuCap

pytestmark = pytest.mark.integration


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_a_capped_process_gets_about_its_share_and_the_cap_goes_away() -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "while True: pass")
    cap = CpuCap(f"tiermesh-chaos-test-{os.getpid()}", 0.1)
    try:
        how = await cap.hold(proc.pid)
        await asyncio.sleep(0.3)  # the first period may still run free
        c0, t0 = _cpu_s(proc.pid), time.monotonic()
        await asyncio.sleep(2.0)
        share = (_cpu_s(proc.pid) - c0) / (time.monotonic() - t0)
        print(f"held by {how}: {share:.2f} of a core")
        assert share < 0.3, (how, share)  # a free busy loop takes a whole core (0.5+ on this shared machine)
    finally:
        await cap.release()
        proc.kill()
        await proc.wait()
    assert cap.released
    if how.startswith("cgroup"):
        assert not any(p.name == cap.name for root in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup"))
                       for p in (root.iterdir() if root.is_dir() else ()))
