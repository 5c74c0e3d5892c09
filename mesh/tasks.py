"""Ending the background tasks a component owns (every task has an owner that stops it)."""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(*tasks: asyncio.Task[object] | None) -> None:
    """Cancel ``tasks`` (``None`` entries are skipped) and wait until each has finished, so nothing
    it holds outlives its owner's ``stop()``."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    for t in live:
        with contextlib.suppress(asyncio.CancelledError):
            await t
