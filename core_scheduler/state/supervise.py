"""Long-lived loops that never die unnoticed: :func:`supervise` runs one for as long as its task lives.

A view's follow task that died of one unexpected error left an agent routing on a frozen view, and nothing said
so. Under :func:`supervise` an error is logged (a ``MeshError``, an expected condition such as etcd being away, as
a warning; anything else with its traceback) and the loop runs again after a jittered back-off
(:class:`mesh.backoff.Backoff`: doubling, so a loop failing at once does not spin, and jittered, so the agents of a
mesh that failed together do not retry together). Only cancellation ends it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from mesh.backoff import Backoff
from mesh.errors import MeshError
from mesh.log import get_logger, kv

__all__ = ["supervise"]

log = get_logger(__name__)


async def supervise(what: str, run: Callable[[], Awaitable[Any]], *, backoff: Backoff | None = None,
                    **fields: Any) -> NoReturn:
    """Run ``run()`` again and again: after an error (logged as ``what``, with ``fields``) or a return (a loop that
    ends is a bug too), once ``backoff`` allows (default: 0.25 s doubling to 5 s). A run that lasted ``4 x cap_s``
    was healthy: the back-off starts over."""
    backoff = backoff or Backoff(0.25, 5.0)
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
        if time.monotonic() - started > 4 * backoff.cap_s:
            backoff.reset()
        await asyncio.sleep(backoff.next())
