"""When a batcher may run a request on the event loop's own thread, and when it must stop.

Handing a batch to the executor and back costs two thread switches and four event-loop turns
(~100-300 µs on a loaded 2-core machine), which is ten times what a tiny variant computes. So a
request that the loop would run *at once and alone* anyway (nothing queued, no batch running, no
window to open for companions) runs on the event-loop thread instead, when the variant's profile
says it takes at most ``INLINE_MAX_MS`` (``edge_agent.batching`` decides that part). That is the
whole bound: the loop is blocked no longer than a tick of its own overhead, and only when nothing
else is batching.

A profile can be wrong (a lock in the runtime, a device), so every inline run is timed and told to
an :class:`InlineGuard`. Two that blocked the loop over ``INLINE_BLOCK_MS`` with no fast run between
(one alone is what a preempted thread on a busy machine looks like), or inline runs over
``INLINE_STALL_MS`` becoming the rule rather than the exception (a moving share above one half; from
none, six slow runs in a row), turn inline runs off for ``INLINE_BACKOFF_S``, doubled each further
time (up to ``INLINE_BACKOFF_MAX_S``) until ``INLINE_CLEAN_RUNS`` inline runs in a row stay fast. A
variant that is slow for real thus ends up on the executor, after a handful of slow runs per
back-off. A preempted thread or a garbage collection makes a run slow now and then on a busy
machine, as it would any code on the loop: a short such pause alone never turns inline runs off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mesh.backoff import Backoff

__all__ = [
    "INLINE_BACKOFF_MAX_S",
    "INLINE_BACKOFF_S",
    "INLINE_BLOCK_MS",
    "INLINE_CLEAN_RUNS",
    "INLINE_MAX_MS",
    "INLINE_SLOW_SHARE",
    "INLINE_STALL_MS",
    "InlineGuard",
]

INLINE_MAX_MS = 0.2
INLINE_STALL_MS = 1.0
INLINE_BLOCK_MS = 20.0
INLINE_SLOW_SHARE = 0.5  # of recent inline runs, weighted 1/8 each
INLINE_CLEAN_RUNS = 1000
INLINE_BACKOFF_S = 2.0
INLINE_BACKOFF_MAX_S = 300.0


@dataclass(slots=True)
class InlineGuard:
    """The stall back-off of one batcher's inline runs (pure state; the caller times the runs)."""

    off_until: float = 0.0
    # not jittered: one site's batchers are no crowd that retries a peer together, and the tables test exact times
    backoff: Backoff = field(default_factory=lambda: Backoff(INLINE_BACKOFF_S, INLINE_BACKOFF_MAX_S, jitter="none"))
    slow_share: float = 0.0  # moving share of inline runs over INLINE_STALL_MS
    clean: int = 0           # inline runs in a row under INLINE_STALL_MS
    blocked: bool = False    # the last slow inline run blocked the loop over INLINE_BLOCK_MS

    def allows(self, now: float) -> bool:
        return now >= self.off_until

    def ran(self, took_ms: float, now: float) -> float:
        """Fold one inline run in; returns the back-off (seconds) it started, or 0.0."""
        if took_ms <= INLINE_STALL_MS:
            self.slow_share *= 0.875
            self.blocked = False
            self.clean += 1
            if self.clean == INLINE_CLEAN_RUNS:
                self.backoff.reset()
            return 0.0
        self.clean = 0
        self.slow_share = 0.875 * self.slow_share + 0.125
        blocking = took_ms > INLINE_BLOCK_MS
        again = blocking and self.blocked  # a blocking run before this one, and no fast run between
        self.blocked = self.blocked or blocking
        # one blocking run between fast ones is a preempted thread on a busy machine (the loop's own code
        # suffers that too); a second before any fast one, or slow runs as the rule, mean the profile is wrong
        if not again and self.slow_share <= INLINE_SLOW_SHARE:
            return 0.0
        # the profile is wrong here: keep off the loop, longer after each time
        self.blocked = False
        self.slow_share = 0.0
        started = self.backoff.next()
        self.off_until = now + started
        return started
