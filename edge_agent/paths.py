"""What a site learns about its paths to other sites, and how long one forward may take: pure.

``PathEstimates`` keeps, per destination, the path overhead observed beyond the routing model's
prediction (serialisation, proxies, event-loop delays, a path going bad), as TCP estimates its
retransmission timeout: a moving mean and mean deviation, of which routing adds
``mean + 2 x deviation`` to the round trip (``build_snapshot``'s ``rtt_correction``). It learns
from failures as well as successes: a forward abandoned at its attempt limit, or whose peer
vanished mid-flight, counts as a path at least as slow as the wait it cost (capped at the attempt
limit, so one dead spell cannot push the estimate past what a timeout measures), and the estimate
fades while the path goes unused, and comes back down as successes return.

``mesh.types.BEST_EFFORT_GRACE_MS`` is how far past its deadline a best-effort query may run: best effort
serves what it can rather than answer ``504`` (``core_scheduler.policy.routing``: the most accurate
variant reachable within the budget, else the most accurate one loaded where the query is), and
that answer may still need a few ms more than the budget. The grace is given once, to a query
whose first decision was best effort (at the hop that decides; a retry that turned best effort for
want of time gets none), and stays inside the SDK's own wait beyond the budget
(``mesh.client.DEADLINE_GRACE_S``, 0.8 s).

``attempt_ms`` is how long one forward attempt may run before it is abandoned for another site:
a generous multiple of what routing expected, so a dead path not yet noticed by heartbeats
(:mod:`mesh.zmq.client`) costs only part of the budget, and never a cut so close to the
deadline that nothing could be tried after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["ATTEMPT_FACTOR", "ATTEMPT_SLACK_MS", "DECAY_S", "MIN_RETRY_MS", "PathEstimates", "attempt_ms"]

DECAY_S = 20.0  # an unused path's learnt overhead halves in ~14 s
ATTEMPT_FACTOR = 2.0  # an attempt may take this many times the expected latency ...
ATTEMPT_SLACK_MS = 50.0  # ... and at least this much beyond it (jitter, a busy machine)
MIN_RETRY_MS = 5.0  # cutting an attempt short must leave at least this for another try


def attempt_ms(remaining_ms: float, expected_ms: float, *, best_effort: bool = False) -> float:
    """How long a forward expected to take ``expected_ms`` may run with ``remaining_ms`` of the
    query's budget left: the whole remainder when the decision was best effort (nothing better
    to retry with) or when cutting it short would leave less than ``MIN_RETRY_MS``."""
    if best_effort or not math.isfinite(expected_ms):
        return remaining_ms
    limit = max(ATTEMPT_FACTOR * expected_ms, expected_ms + ATTEMPT_SLACK_MS)
    return limit if limit <= remaining_ms - MIN_RETRY_MS else remaining_ms


@dataclass(slots=True)
class PathEstimates:
    """Learnt path overhead per destination site: (mean, mean deviation, when last observed)."""

    decay_s: float = DECAY_S
    paths: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def observe(self, site: str, excess_ms: float, now: float) -> None:
        """Fold one success: the actual network time minus the predicted, in ms."""
        excess = max(0.0, excess_ms)
        mean, dev, _ = self.paths.get(site, (excess, excess / 2, 0.0))
        dev = 0.75 * dev + 0.25 * abs(excess - mean)
        mean = 0.875 * mean + 0.125 * excess
        self.paths[site] = (mean, dev, now)

    def observe_failure(self, site: str, waited_ms: float, expected_ms: float, limit_ms: float,
                        now: float) -> bool:
        """Fold one failed forward that waited ``waited_ms`` (capped at the attempt's ``limit_ms``)
        for a reply expected in ``expected_ms``. A failure that came sooner than expected (a peer
        already known dead) says nothing about the path's speed: not folded. Returns whether it was."""
        waited = min(waited_ms, limit_ms)
        if not waited > expected_ms:
            return False
        self.observe(site, waited - expected_ms, now)
        return True

    def correction(self, now: float) -> dict[str, float]:
        """Extra round-trip ms per site for routing, faded by the time since its last observation."""
        return {s: (mean + 2 * dev) * math.exp(-max(0.0, now - seen) / self.decay_s)
                for s, (mean, dev, seen) in self.paths.items()}
