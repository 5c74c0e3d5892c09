"""Polling until a condition holds, bounded in time (for tests that watch a distributed system settle)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float, what: str,  # noqa: ASYNC109
                     interval: float = 0.1) -> Any:
    """``check()``'s first truthy result; ``AssertionError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(interval)
