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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MAX_INTERVAL_S", "MIN_INTERVAL_S", "SHARE", "TablePacer"]

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
