"""A query that waited through a freeze of its edge's process is charged from the freeze's start (issue 31: a
frozen edge, thawed, ran the queries its clients had abandoned and had answered elsewhere)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from edge_agent.stall_watch import CATCH_UP_S, STALL_S, StallWatch
from mesh import clock

pytestmark = pytest.mark.unit


@pytest.mark.asyncio
async def test_arrival_is_now_without_a_stall_and_the_stalls_start_around_one() -> None:
    async with StallWatch() as watch:
        t0 = clock.monotonic()
        watch.observe_tick(t0)
        assert watch.arrival(t0 + 0.01) == t0 + 0.01  # a tick 10 ms ago: nothing held this query
        # woken after 2 s: the first callbacks run before the watch's tick
        assert watch.arrival(t0 + 2.0) == t0
        watch.observe_tick(t0 + 2.0)
        assert watch.stalls == 1
        assert watch.arrival(t0 + 2.0 + CATCH_UP_S / 2) == t0  # handled while catching up: may have waited
        later = t0 + 2.0 + 2 * CATCH_UP_S
        for k in range(1, int(2 * CATCH_UP_S / 0.05) + 1):  # ticking on time again
            watch.observe_tick(t0 + 2.0 + k * 0.05)
        assert watch.arrival(later) == later  # caught up
        # a quota's stall, shorter than STALL_S, is not a freeze
        watch.observe_tick(later + STALL_S / 2)
        assert watch.stalls == 1 and watch.arrival(later + STALL_S / 2) == later + STALL_S / 2


@pytest.mark.asyncio
async def test_a_stopped_watch_charges_nothing() -> None:
    watch = StallWatch()
    assert watch.arrival(123.0) == 123.0
    async with watch:
        pass
    assert watch.arrival(456.0) == 456.0


def test_a_real_freeze_of_the_process_is_noticed() -> None:
    """SIGSTOP / SIGCONT of a child running a watch: it reports the stall and charges from its start."""
    code = (
        "import asyncio, sys, time\n"
        "from edge_agent.stall_watch import StallWatch\n"
        "async def main():\n"
        "    async with StallWatch() as w:\n"
        "        print('ready', flush=True)\n"
        "        for _ in range(200):\n"
        "            await asyncio.sleep(0.02)\n"
        "            if w.stalls: break\n"
        "        print('stalls', w.stalls, flush=True)\n"
        "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.6)
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.strip() == "stalls 1", out


@pytest.mark.asyncio
async def test_the_tick_task_is_owned() -> None:
    watch = StallWatch(tick_s=0.001)
    await watch.start()
    await asyncio.sleep(0.01)
    await watch.stop()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "stall-watch"]
