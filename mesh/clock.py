"""The two clocks of tiermesh, read in one place.

* :func:`monotonic` — local instants: deadlines, timers, ages. Its origin is arbitrary and
  private to the host, so a monotonic instant never leaves the process: the wire carries a
  *duration* (a query's remaining budget) and each hop turns it back into an instant on its own
  monotonic clock when the message arrives. It is ``time.monotonic``, the clock asyncio's loop
  runs on, so ``loop.call_at(deadline, ...)`` and these instants agree.
* :func:`wall` — unix time, for what people and logs read (heartbeat ``ts``, the wire's
  ``sent_at``, events). Sites' wall clocks may disagree by seconds: nothing correct may depend
  on comparing one site's wall time with another's.

Tests only: ``TIERMESH_CLOCK_OFFSET_S`` (seconds, may be negative) is added to every :func:`wall`
reading of the process, so one agent can run with a skewed wall clock and a system test can show
that no decision compares wall clocks across sites. :func:`set_wall_offset` does the same in
process. It never touches :func:`monotonic`. Read once, on the first :func:`wall` call (never at
import time); a value that is not a finite number is a ``ConfigError`` there.
"""

from __future__ import annotations

import math
import os
import time
from typing import Final

from mesh.errors import ConfigError

__all__ = ["CLOCK_OFFSET_ENV", "monotonic", "set_wall_offset", "wall", "wall_offset"]

CLOCK_OFFSET_ENV: Final = "TIERMESH_CLOCK_OFFSET_S"

monotonic = time.monotonic

_offset: float | None = None


def wall_offset() -> float:
    """Seconds added to :func:`wall` in this process (0 unless a test set a skew)."""
    global _offset
    if _offset is None:
        raw = os.environ.get(CLOCK_OFFSET_ENV, "").strip()
        try:
            value = float(raw) if raw else 0.0
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ConfigError(f"{CLOCK_OFFSET_ENV} must be a finite number of seconds, got {raw!r}")
        _offset = value
    return _offset


def set_wall_offset(seconds: float | None) -> None:
    """Skew this process's wall clock by ``seconds`` (tests only); ``None``: back to the env's."""
    global _offset
    if seconds is not None and not math.isfinite(seconds):
        raise ConfigError(f"wall clock offset must be finite, got {seconds!r}")
    _offset = seconds


def wall() -> float:
    """Unix seconds as this process believes them (``time.time()`` plus any test skew)."""
    off = _offset if _offset is not None else wall_offset()
    return time.time() + off
