"""A liveness loop stops even when its stop arrives just as a record's write completes.

On Python 3.11, ``asyncio.wait_for`` returns the inner result when the cancellation that interrupts it finds the
inner already done (CPython gh-86296): the cancellation is lost, the loop sleeps on, and ``stop()`` waits for it
forever. The control_plane benchmark hung that way at 1,000 sites. The store here is a stand-in whose write
completes exactly when the test says, so the race is taken every time, not by chance."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from core_scheduler.state.heartbeat import Heartbeat, PublishPolicy
from edge_agent.liveness import Liveness

pytestmark = pytest.mark.unit


class _Lease:
    id, alive = 1, True

    async def revoke(self) -> None:
        return None


class _Store:
    """The first write (at start) answers at once; the next waits for ``pending``."""

    def __init__(self) -> None:
        self.puts = 0
        self.pending: asyncio.Future[int] | None = None

    async def lease(self, ttl: float) -> _Lease:
        return _Lease()

    async def put(self, key: str, value: Any, lease: Any = None) -> int:
        self.puts += 1
        if self.puts == 1:
            return 1
        self.pending = asyncio.get_running_loop().create_future()
        return await self.pending


async def test_a_stop_that_meets_a_completing_write_is_not_lost() -> None:
    store = _Store()
    rec = Heartbeat(site="e1", endpoint="tcp://x:1", capacity=4)
    live = Liveness(store, "e1", lambda: rec, ttl_s=3.0, interval_s=0.01,  # type: ignore[arg-type]
                    policy=PublishPolicy(max_interval_s=0.0))  # every look writes
    await live.start()
    for _ in range(500):
        if store.pending is not None:
            break
        await asyncio.sleep(0.01)
    assert store.pending is not None, "the loop never wrote again"
    store.pending.set_result(2)        # the write completes ...
    stop = asyncio.ensure_future(live.stop())  # ... and the stop's cancellation comes in the same turn
    done, _ = await asyncio.wait({stop}, timeout=5.0)
    assert stop in done, "stop() hung: the loop swallowed its cancellation"
