"""What a site learns about its paths to other sites, and how long one forward may take: pure.

``PathEstimates`` keeps, per destination, the path overhead observed beyond the routing model's
prediction (serialisation, proxies, a path going bad), as TCP estimates its retransmission timeout:
a moving mean and mean deviation, of which routing adds ``mean + 2 x deviation`` to the round trip
(``build_snapshot``'s ``rtt_correction``). It learns from failures as well as successes: a forward
abandoned at its attempt limit, or whose peer vanished mid-flight, counts as a path at least as slow
as the wait it cost (capped at the attempt limit, so one dead spell cannot push the estimate past
what a timeout measures), and the estimate fades while the path goes unused, and comes back down as
successes return. A sample is the time taken minus what the routing model planned *before* this
correction (``SiteDataPlane`` subtracts the correction the table in force was built with from the
decision's expected latency): measured against the corrected plan, each sample shrank as the
correction grew, and a path 20 ms slower than declared settled near 7 ms.

What is not the path's. The door's own delays (its event loop running late: CPU quota throttling,
TLS handshakes and other requests' work on the same loop) are measured by the caller and passed as
``local_ms``: subtracted from the sample, and counted apart (``local_delay_ms``, ``local_total_ms``)
so that metrics can show them. Seen in issue 30: a capped edge booked its own stalls as path excess,
and routing then called a good path infeasible.

A path starts from what the topology declares (excess mean 0, deviation ``PRIOR_DEV_MS``), not from
its first sample, which used to set mean = excess and deviation = excess / 2: one 200 ms answer in
the first forwards after start added 350 ms to that path's round trip, and fast answers took it back
down only slowly (the replay below). A success's deviation from the mean is clipped (a Huber step) to
``max(CLIP_FLOOR_MS, CLIP_DEVS x deviation)`` before it is folded, so one slow answer moves the
estimate by a bounded step, while a sustained excess, whose every sample raises the deviation and so
the clip, still gets through within a few answers. An answer faster than the mean pulls the mean down
with twice the gain of a slower one (1/4 against 1/8), so the estimate recovers in a few successes.
Failures are folded unclipped: an attempt that cost its whole limit was measured, not jitter. With
the constants below, replayed in ``tests/unit/test_paths_retry.py`` (excess in ms, 0-2 ms normal):

    first answers 200, 150, 80 (local stalls not measured)   correction peaks at 16 ms (was 373 ms);
                                                              4.4 ms after 8 fast answers (was 252),
                                                              2.2 after 16, the calm path's own (was 101)
    a path 30 ms slower from now on                          24 ms after 4 answers, 45 after 7
                                                              (was 45 after 4)
    one answer in three 40 ms late                           42 ms on average (was 51)
    one answer in five 60 ms late                            7 ms (was 53): recurring outliers that rare
                                                              are taken as noise while answers succeed;
                                                              ones that cost an attempt limit still count

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

__all__ = ["ATTEMPT_FACTOR", "ATTEMPT_SLACK_MS", "CLIP_DEVS", "CLIP_FLOOR_MS", "DECAY_S", "MIN_RETRY_MS",
           "PRIOR_DEV_MS", "PathEstimates", "attempt_ms"]

DECAY_S = 20.0  # an unused path's learnt overhead halves in ~14 s
ATTEMPT_FACTOR = 2.0  # an attempt may take this many times the expected latency ...
ATTEMPT_SLACK_MS = 50.0  # ... and at least this much beyond it (jitter, a busy machine)
MIN_RETRY_MS = 5.0  # cutting an attempt short must leave at least this for another try
PRIOR_DEV_MS = 1.0  # a path never observed: no excess over its declared latency, this much deviation
CLIP_FLOOR_MS = 8.0  # a success moves the estimate as if at most this much (or ...
CLIP_DEVS = 3.0  # ... this many deviations) slower than the mean
GAIN_UP, GAIN_DOWN, GAIN_DEV = 1 / 8, 1 / 4, 1 / 4  # mean on a slower / faster answer; deviation (RFC 6298's)
LOCAL_GAIN = 1 / 8  # the door's own delay per forward: a moving mean


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
    """Learnt path overhead per destination site: (mean, mean deviation, when last observed); and
    the door's own delays, counted apart from every path's."""

    decay_s: float = DECAY_S
    paths: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    local_total_ms: float = 0.0  # the door's own delay, summed over every forward observed
    local_mean_ms: float = 0.0  # ... and its moving mean per forward

    def observe(self, site: str, excess_ms: float, now: float, local_ms: float = 0.0) -> None:
        """Fold one success: the actual network time minus the predicted, in ms, of which
        ``local_ms`` was the door's own delay (not the path's)."""
        self._fold(site, max(0.0, excess_ms - self._local(local_ms)), now, clip=True)

    def observe_failure(self, site: str, waited_ms: float, expected_ms: float, limit_ms: float,
                        now: float, local_ms: float = 0.0) -> bool:
        """Fold one failed forward that waited ``waited_ms``, of which ``local_ms`` was the door's own delay
        (the rest capped at the attempt's ``limit_ms``), for a reply expected in ``expected_ms``. A failure that came
        sooner than expected (a peer already known dead) says nothing about the path's speed: not folded.
        Returns whether it was. Not clipped as a success is: the wait was the path's (or the peer's)."""
        waited = min(waited_ms - self._local(local_ms), limit_ms)
        if not waited > expected_ms:
            return False
        self._fold(site, waited - expected_ms, now, clip=False)
        return True

    def correction(self, now: float) -> dict[str, float]:
        """Extra round-trip ms per site for routing, faded by the time since its last observation."""
        return {s: (mean + 2 * dev) * math.exp(-max(0.0, now - seen) / self.decay_s)
                for s, (mean, dev, seen) in self.paths.items()}

    def local_delay_ms(self) -> float:
        """The door's own delay per forward (moving mean, ms): what was taken out of the paths' samples."""
        return self.local_mean_ms

    def _fold(self, site: str, excess: float, now: float, *, clip: bool) -> None:
        mean, dev, _ = self.paths.get(site, (0.0, PRIOR_DEV_MS, 0.0))
        err = excess - mean
        if err >= 0:
            if clip:
                err = min(err, max(CLIP_FLOOR_MS, CLIP_DEVS * dev))
            mean += GAIN_UP * err
        else:
            mean += GAIN_DOWN * err
        dev += GAIN_DEV * (abs(err) - dev)
        self.paths[site] = (mean, dev, now)

    def _local(self, local_ms: float) -> float:
        local = max(0.0, local_ms) if math.isfinite(local_ms) else 0.0
        self.local_total_ms += local
        self.local_mean_ms += LOCAL_GAIN * (local - self.local_mean_ms)
        return local
