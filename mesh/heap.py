"""Keeping the cyclic garbage collector's pauses off the query path.

A serving process allocates tens of thousands of short-lived objects a second (a future, a task, a dict per
query). CPython's collector then runs its oldest generation every second or so, and a full collection walks
every tracked object the process holds: the modules, ONNX Runtime's and numpy's Python objects, the mesh's
view (~110 k objects in the shared_backbone benchmark's process holding a few variants). Measured on this
project's 2-core machine (``bench.shared_backbone``'s deployments at 13 k req/s, pauses timed with
``gc.callbacks`` in a diagnostic run): two 30-46 ms pauses per 2.5 s, each a burst of late or refused queries
under a 20 ms SLO; with the heap settled, no pause over 5 ms in the same runs.

:func:`settle` collects once and then moves every object alive to the permanent generation (``gc.freeze``),
which the collector never walks: later full collections see only what was allocated since. Long-lived objects
are made at start and when a variant loads, so that is when it runs; it runs again when a variant unloads,
after ``gc.unfreeze``, so that what the unloaded variant left in reference cycles among frozen objects is freed
rather than held for ever. Each call is one full collection (tens of ms, once, off the steady state).
"""

from __future__ import annotations

import gc
import time

from mesh.log import get_logger, kv

__all__ = ["settle"]

log = get_logger(__name__)


def settle(why: str) -> int:
    """Unfreeze, collect everything, freeze what survived; returns how many objects are frozen now."""
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("heap settled after %s: %d objects frozen in %.1f ms", why, frozen,
              (time.perf_counter() - started) * 1000.0, extra=kv(event="heap_settle"))
    return frozen
