"""How often a site rebuilds its routing table when only load reports changed (issue 30): pure.

Every change of the mesh view used to rebuild the routing table (``MeshSnapshot`` then ``RoutingTable.build``), and
the view changes with every heartbeat of every site: several times a second on a seven-site mesh. A rebuild costs a
few milliseconds of CPU at full speed; at an edge capped to a tenth of a core that is tens of milliseconds of its
time, and a profile of the demo's edge-par-1 (``py-spy``, 20 s under the demo's workload) found 45 % of its samples
in ``RoutingTable.build``, against 8 % in serving queries: the edge spent its CPU on keeping its table fresh while
its queries waited.

A change of what the mesh *is* (a site joining or leaving, placement, the catalog, the topology, a full re-read) is
still routed on at once. A change that is only load (the kinds changed since the last notification are ``live``
and the set of live sites is the same) rebuilds no more often than keeps rebuilding under ``share`` of the site's
CPU: every ``cost / (share x cores)`` seconds, ``cost`` a moving mean of a rebuild's CPU time, within
[``MIN_INTERVAL_S``, ``MAX_INTERVAL_S``]. An uncapped site (2 cores, a 5 ms rebuild) rebuilds as before, at the
view's own debounce; a 0.1-core edge (rebuilds of 4-7 ms of CPU, measured) about every half second, routing
meanwhile on load figures up to that old. Alone it did not measurably help the demo's tight class, served at the
edges (98.1 % in one run before, 96.8-99.3 % in five after: run-to-run spread is that large); what did was building
each task's candidates only when routed (``core_scheduler.policy.routing_candidates.TaskTables``): README, Demo
results.

A rebuild for heartbeats alone is also skipped when nothing it routes on changed (:func:`routing_inputs`; a change
of what the mesh is always builds): most heartbeats repeat what
the last said (the same variants loaded, empty queues, room left), and a table built again from them is the table
in force. A rebuild blocks the event loop for its whole CPU time, ten times that in wall time at a tenth of a core
(4-5 ms of CPU, measured: about 50 ms during which no query is served), so the demo's tight class (10 ms) missed
its budget for the queries that arrived meanwhile.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core_scheduler.policy.snapshot import MeshSnapshot

__all__ = ["FLOOR_MS", "MAX_INTERVAL_S", "MEMORY_STEP_BYTES", "MIN_INTERVAL_S", "SHARE", "STEP", "TablePacer",
           "bucket", "routing_inputs", "same_routing"]

SHARE = 0.1            # at most this share of the site's CPU rebuilds the table for load-only changes
MIN_INTERVAL_S = 0.2   # the agent view's own debounce: no pacing below it
MAX_INTERVAL_S = 2.0   # load figures never older than this (heartbeats come every 0.5-1 s)
GAIN = 0.25            # moving mean of a rebuild's CPU time


@dataclass(slots=True)
class TablePacer:
    """``cores``: the CPU the site may use (its cap, else the machine's)."""

    cores: float
    share: float = SHARE
    cost_s: float = 0.0        # moving mean of a rebuild's CPU seconds (0: none measured yet)
    last: float = -math.inf    # when the last rebuild ran (monotonic seconds)

    def observe(self, cpu_s: float, now: float) -> None:
        """A rebuild ran at ``now`` and cost ``cpu_s`` seconds of CPU."""
        cpu_s = max(0.0, cpu_s)
        self.cost_s = cpu_s if self.cost_s == 0.0 else self.cost_s + GAIN * (cpu_s - self.cost_s)
        self.last = now

    def interval_s(self) -> float:
        """The least time between two rebuilds for load-only changes."""
        if self.cores <= 0 or self.share <= 0:
            return MAX_INTERVAL_S
        return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, self.cost_s / (self.share * self.cores)))

    def wait_s(self, now: float, *, structural: bool) -> float:
        """Seconds to wait before rebuilding for a change seen at ``now`` (0: rebuild now). ``structural``: the
        change is more than load reports, routed on at once."""
        if structural:
            return 0.0
        return max(0.0, self.last + self.interval_s() - now)


STEP = 1.15                    # queues and learned path corrections that differ by less than this ratio route alike
FLOOR_MS = 0.5                 # below it a queue is empty, a correction none
MEMORY_STEP_BYTES = 4 << 20    # free memory, rounded down to this (what a cold load's fit reads)


def bucket(ms: float) -> int:
    """``ms`` (a queue's expected wait, a path's learned extra round trip) in steps of :data:`STEP` (0: below
    :data:`FLOOR_MS`)."""
    if not ms >= FLOOR_MS:  # NaN too
        return 0
    if math.isinf(ms):  # a queue that never drains: one step above every finite one
        return sys.maxsize
    return 1 + int(math.log(ms / FLOOR_MS) / math.log(STEP))


def routing_inputs(snap: MeshSnapshot, correction: Mapping[str, float] | None, revisions: Mapping[str, int],
                   generation: int = 0) -> tuple[object, ...]:
    """What a routing table built from ``snap`` routes on, in buckets: two snapshots with equal inputs build tables
    that route alike, and the second need not be built. ``revisions``: the view's revision per kind of key (all but
    heartbeats'), ``generation`` its count of full re-reads; ``correction``: the door's learned extra round trip per
    site, added to ``snap.rtt_ms`` (last, see :func:`same_routing`). Catalog, cascades and paths are compared by
    identity (the snapshot builder keeps each object while its input is the
    same); heartbeats by what routing reads of them: which variants are loaded, their queues (in steps), whether
    the site takes more and the memory it has free (for a cold load)."""
    loads = tuple(sorted(
        (name, ld.loaded, tuple(sorted((v, bucket(q)) for v, q in ld.queue_ms.items() if v in ld.loaded)),
         ld.has_capacity, ld.memory_free_bytes // MEMORY_STEP_BYTES)
        for name, ld in snap.loads.items()))
    sites = tuple(sorted((n, s.alive, s.hardware_class, s.gpus, s.device_budget_bytes) for n, s in snap.sites.items()))
    placement = tuple(sorted(snap.placement.items()))
    rtt = tuple(sorted((s, bucket(c)) for s, c in (correction or {}).items()))
    return (generation, tuple(sorted((k, v) for k, v in revisions.items() if k != "live")), id(snap.variants),
            id(snap.cascades), id(snap.bandwidth_mbps), id(snap.margin_ms), snap.store_site, sites, loads,
            placement, rtt)


def same_routing(held: tuple[object, ...] | None, new: tuple[object, ...], age_s: float) -> bool:
    """Whether a table built from ``held`` (:func:`routing_inputs`), ``age_s`` seconds ago, routes as one built from
    ``new`` would. The learned path corrections (the last input) move with every forward's sample, in and out of
    their steps several times a second under traffic: a change of them alone is taken up every
    :data:`MAX_INTERVAL_S`, not at once."""
    if held is None:
        return False
    if held[:-1] != new[:-1]:
        return False
    return held[-1] == new[-1] or age_s < MAX_INTERVAL_S
