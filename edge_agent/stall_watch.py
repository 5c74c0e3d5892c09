"""When a query really arrived, across a stall of this whole process (SIGSTOP, a paused VM, a swap storm).

A door stamps a query's arrival when its handler starts, and its budget runs from there. A process that was frozen
finds, on waking, requests that its kernel accepted and buffered meanwhile, and would stamp each of them "now": a
query its caller gave up on seconds ago (and, with ``mesh.Client([...])``, had answered by another edge) got a whole
fresh budget and was run again. Seen in ``tests/system/test_sdk_frozen_edge.py``: 3-5 abandoned queries per freeze
were run, each with its full 150 ms "left".

``StallWatch`` ticks every ``tick_s`` and notices a tick that came more than ``stall_s`` late: the process did not
run in between. ``arrival(now)`` is then the stall's start for a query handled while the stall is not yet noticed
(the first callbacks after waking run before the tick's) or within ``catch_up_s`` of its end, since such a query may
have been waiting since it began; otherwise ``now``. Charging a query from the stall's start is the conservative
reading (the caller's budget has run at least that long if the query came in early in the stall), so a query that
waited out a freeze longer than its budget is refused ``deadline`` instead of run, and one with budget to spare still
runs, knowing what is left. A query that came in fresh in the ``catch_up_s`` after a stall is charged the stall too:
rare, and it is refused only if the stall was longer than its budget.

Stalls shorter than ``stall_s`` (a CPU quota's, a few to tens of ms: :mod:`tiermesh.caps`) are not this module's:
the door's own delay is measured per query (``door_delay_ms``). A tick costs one timer callback: 20 a second.
"""

from __future__ import annotations

import asyncio

from mesh import clock
from mesh.lifecycle import Service, State, cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["CATCH_UP_S", "STALL_S", "TICK_S", "StallWatch"]

log = get_logger(__name__)

TICK_S = 0.05
STALL_S = 0.2  # a tick this late: the process was stopped
CATCH_UP_S = 0.25  # queries handled this soon after a stall ended may have waited through it (a backlog of
# new connections is accepted, read and handled over several turns of the loop after the first tick)


class StallWatch(Service):
    """Notices stalls of this process; ``arrival(now)`` says from when a query handled at ``now`` is charged."""

    def __init__(self, *, tick_s: float = TICK_S, stall_s: float = STALL_S, catch_up_s: float = CATCH_UP_S) -> None:
        self.tick_s, self.stall_s, self.catch_up_s = tick_s, stall_s, catch_up_s
        self.stalls = 0
        self._last_tick = clock.monotonic()
        self._stall: tuple[float, float] | None = None  # (start, end) of the last stall noticed
        self._task: asyncio.Task[None] | None = None

    def arrival(self, now: float) -> float:
        """The instant a query handled at ``now`` is charged from (``now`` unless a stall may have held it)."""
        if self.state is not State.RUNNING:
            return now
        if now - self._last_tick > self.stall_s:  # woken, and the tick has not run yet
            return self._last_tick
        stall = self._stall
        if stall is not None and now - stall[1] <= self.catch_up_s:
            return min(now, stall[0])
        return now

    def observe_tick(self, now: float) -> None:
        """One tick at ``now`` (the loop's, or a test's)."""
        if now - self._last_tick > self.stall_s:
            self._stall = (self._last_tick, now)
            self.stalls += 1
            log.warning("this process did not run for %.0f ms: queries that waited through it are charged from "
                        "its start", (now - self._last_tick) * 1000.0,
                        extra=kv(event="process_stall", stall_ms=round((now - self._last_tick) * 1000.0, 1)))
        self._last_tick = now

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.observe_tick(clock.monotonic())

    async def _start(self) -> None:
        self._last_tick = clock.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="stall-watch")

    async def _stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
