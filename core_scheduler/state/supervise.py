"""Long-lived loops that never die unnoticed: :func:`supervise` runs one for as long as its task lives.

A view's follow task that died of one unexpected error left an agent routing on a frozen view, and nothing said
so. Under :func:`supervise` an error is logged (a ``MeshError``, an expected condition such as etcd being away, as
a warning; anything else with its traceback) and the loop runs again after a jittered back-off (:class:`Backoff`:
doubling, so a loop failing at once does not spin, and jittered, so the agents of a mesh that failed together do
not retry together). Only cancellation ends it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from mesh.errors import MeshError
from mesh.log import get_logger, kv

__all__ = ["Backoff", "supervise"]

log = get_logger(__name__)


class Backoff:
    """Delays before retries: ``first_s`` doubling up to ``max_s``, each drawn from [0.5, 1.5) of its step."""

    def __init__(self, first_s: float = 0.25, max_s: float = 5.0) -> None:
        self.first_s, self.max_s = first_s, max_s
        self._step = first_s

    def next(self) -> float:
        delay = self._step * random.uniform(0.5, 1.5)
        self._step = min(self._step * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._step = self.first_s


async def supervise(what: str, run: Callable[[], Awaitable[Any]], *, backoff: Backoff | None = None,
                    **fields: Any) -> NoReturn:
    """Run ``run()`` again and again: after an error (logged as ``what``, with ``fields``) or a return (a loop that
    ends is a bug too), once ``backoff`` allows. A run that lasted ``4 x max_s`` was healthy: the back-off starts
    over."""
    backoff = backoff or Backoff()
    while True:
        started = time.monotonic()
        try:
            await run()
            log.warning("%s ended; running it again", what, extra=kv(**fields))
        except asyncio.CancelledError:
            raise
        except MeshError as exc:
            log.warning("%s failed, retrying: %s", what, exc, extra=kv(**fields))
        except Exception:
            log.exception("%s failed, restarting it", what, extra=kv(**fields))
        if time.monotonic() - started > 4 * backoff.max_s:
            backoff.reset()
        await asyncio.sleep(backoff.next())
