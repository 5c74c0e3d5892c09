"""Keeping the cyclic garbage collector's pauses off the query path.

A serving process allocates tens of thousands of short-lived objects a second (a future, a task, a dict per
query). CPython's collector then runs its oldest generation every second or so, and a full collection walks
every tracked object the process holds: the modules, ONNX Runtime's and numpy's Python objects, the mesh's
view (~110 k objects in the shared_backbone benchmark's process holding a few variants). Measured on this
project's 2-core machine (``bench.shared_backbone``'s deployments at 13 k req/s, pauses timed with
``gc.callbacks`` in a diagnostic run): two 30-46 ms pauses per 2.5 s, each a burst of late or refused queries
under a 20 ms SLO; with the heap settled, no pause over 5 ms in the same runs.

:func:`settle` collects and then moves every object alive to the permanent generation (``gc.freeze``), which
the collector never walks: later full collections see only what was allocated since. Long-lived objects are made
at start and when a variant loads, so that is when it runs; a collection then walks only what is not frozen yet
(what start or the load made), not the whole heap again. After a variant unloads it runs with ``thaw=True``: after
``gc.unfreeze``, so that what the unloaded variant left in reference cycles among frozen objects is freed rather
than held for ever. That one is a full collection (tens of ms; 100-500 ms for 20 agents on two cores), so a
:class:`Settler` owes it rather than paying it at once: one thaw when its host has been quiet for a while, for a
whole burst of unloads (a site profiling its variants loads and unloads one after the other at start). It also
waits for a moment without queries (``idle_s``, the host's door): at a tenth of a core the thaw's 50-180 ms of CPU
stopped an edge for 0.5-1.8 s, and queries that came in meanwhile were refused (issue 30's demo, where placement's
evictions after the warm-up led to a thaw in the workload's first second). What it frees is small: an unloaded
variant's session and its weights go when it is unloaded (``Runtime.unload_sync`` drops them); the thaw collects the
Python objects left in reference cycles among frozen ones (a batcher and its task, the runtime wrapper). So it waits
for a second without queries, at most :data:`MAX_DEFER_S`, and a busy site holds those objects a while longer.

Walking the whole heap at every load was what made 20 forked agents of ``tiermesh up`` take 2-3 s longer to come
up on two cores (a full pass per load per agent, each one touching, and so copying, the pages the child shared with
its launcher); the launcher freezes its own imports before it forks for the same reason.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

from mesh.log import get_logger, kv

__all__ = ["IDLE_NEED_S", "MAX_DEFER_S", "Settler", "settle"]

IDLE_NEED_S = 1.0    # a thaw owed runs once the host has had no query for this long ...
MAX_DEFER_S = 300.0  # ... or this long after it fell due, whatever the traffic

log = get_logger(__name__)


def settle(why: str, *, thaw: bool = False) -> int:
    """Collect what is not frozen yet (everything with ``thaw``, after ``gc.unfreeze``), then freeze what survived;
    returns how many objects are frozen now."""
    started = time.perf_counter()
    if thaw:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("heap settled after %s: %d objects frozen in %.1f ms", why, frozen,
              (time.perf_counter() - started) * 1000.0, extra=kv(event="heap_settle"))
    return frozen


class Settler:
    """Settles a serving host's heap: at once after a load (cheap: only what is not frozen yet is walked), and with
    a thaw :attr:`quiet_s` after the last load or unload that followed an unload (one full collection per burst).

    Owned by its host: :meth:`close` cancels a thaw still owed. Runs on the event loop that calls it."""

    def __init__(self, quiet_s: float = 2.0, *, idle_s: Callable[[], float] | None = None,
                 idle_need_s: float = IDLE_NEED_S, max_defer_s: float = MAX_DEFER_S) -> None:
        self.quiet_s = quiet_s
        self.idle_s, self.idle_need_s, self.max_defer_s = idle_s, idle_need_s, max_defer_s
        self.thaws = 0
        self.deferred = 0  # times a thaw that fell due waited for a moment without queries
        self._owed: asyncio.TimerHandle | None = None
        self._due_since: float | None = None

    @property
    def owed(self) -> bool:
        return self._owed is not None

    def loaded(self, why: str) -> None:
        settle(why)
        if self._owed is not None:  # still in a burst: the thaw waits for quiet
            self._arm()

    def unloaded(self) -> None:
        self._arm()

    def _arm(self) -> None:
        if self._owed is not None:
            self._owed.cancel()
        self._owed = asyncio.get_running_loop().call_later(self.quiet_s, self._thaw)

    def _thaw(self) -> None:
        now = time.monotonic()
        if self._due_since is None:
            self._due_since = now
        if (self.idle_s is not None and self.idle_s() < self.idle_need_s
                and now - self._due_since < self.max_defer_s):
            self.deferred += 1  # queries are being served: not now (module docstring)
            self._owed = asyncio.get_running_loop().call_later(min(0.5, self.idle_need_s), self._thaw)
            return
        self._owed = self._due_since = None
        self.thaws += 1
        settle("unloads", thaw=True)

    def close(self) -> None:
        if self._owed is not None:
            self._owed.cancel()
            self._owed = None
        self._due_since = None
