"""The one back-off of every retry loop: delays that grow from ``base_s`` by ``factor`` up to ``cap_s``, jittered.

Jitter is what keeps a mesh that failed together (etcd away, a leader gone, a peer restarted) from coming back
together: without it every agent's retries land on the recovering server in the same instants. The kinds, with
``step`` the un-jittered delay of this attempt (``base_s x factor^n``, capped) and ``u`` a draw in [0, 1):

    full           u x step                              (AWS's "full jitter": the most spread, may be ~0)
    equal          step x (1 + u) / 2                    (half to all of the step: spread, and never spins)
    decorrelated   min(cap_s, base_s + u x (3 x previous - base_s))   (grows from the last delay, not a count)
    none           step                                   (tests, and loops whose peers are not a crowd)

Pure state: no clock, no I/O, the draw injectable (``rand``), so a test replays a sequence exactly. A loop keeps one
:class:`Backoff`, sleeps :meth:`~Backoff.next` after a failure and calls :meth:`~Backoff.reset` after a success.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Literal

__all__ = ["Backoff", "Jitter"]

Jitter = Literal["full", "equal", "decorrelated", "none"]
_KINDS = ("full", "equal", "decorrelated", "none")


class Backoff:
    """Delays (seconds) before the retries of one loop. ``rand`` draws from [0, 1) (default ``random.random``)."""

    __slots__ = ("_last", "_rand", "_step", "attempts", "base_s", "cap_s", "factor", "jitter")

    def __init__(self, base_s: float, cap_s: float, *, factor: float = 2.0, jitter: Jitter = "equal",
                 rand: Callable[[], float] = random.random) -> None:
        if not 0.0 < base_s <= cap_s:
            raise ValueError(f"back-off needs 0 < base_s <= cap_s, got {base_s} and {cap_s}")
        if factor < 1.0:
            raise ValueError(f"back-off factor must be >= 1, got {factor}")
        if jitter not in _KINDS:
            raise ValueError(f"unknown jitter {jitter!r}; expected one of {_KINDS}")
        self.base_s, self.cap_s, self.factor, self.jitter = base_s, cap_s, factor, jitter
        self._rand = rand
        self._step = base_s   # the un-jittered delay of the next attempt
        self._last = base_s   # the last delay given (decorrelated jitter grows from it)
        self.attempts = 0     # delays given since the last reset

    def next(self) -> float:
        """The delay before the next retry; each call is one more failure."""
        step = self._step
        self._step = min(step * self.factor, self.cap_s)
        self.attempts += 1
        kind = self.jitter
        if kind == "none":
            delay = step
        elif kind == "full":
            delay = step * self._rand()
        elif kind == "equal":
            delay = step * (1.0 + self._rand()) / 2.0
        else:  # decorrelated: between base and three times the last delay
            delay = min(self.cap_s, self.base_s + self._rand() * (3.0 * self._last - self.base_s))
        self._last = delay
        return delay

    def reset(self) -> None:
        """After a success: the next failure starts from ``base_s`` again."""
        self._step = self._last = self.base_s
        self.attempts = 0

    def __repr__(self) -> str:
        return (f"Backoff(base_s={self.base_s}, cap_s={self.cap_s}, factor={self.factor}, jitter={self.jitter!r}, "
                f"attempts={self.attempts})")
