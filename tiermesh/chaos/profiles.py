"""The chaos profiles. ``short`` runs in ``make test`` (about a minute of workload on the small topology);
``long`` in ``make chaos`` (every fault kind, several of them twice).

The small topology (``tests/data/topology_small.yaml``): core-eu <- mid-eu <- edge-fra-1, edge-par-1.
Faults are spaced so that each has its recovery bound (plus an attainment window) before the next.

The recovery bound: after a heal, what can still be wrong is a lease to re-grant or expire (3 s TTL) and
a peer to probe back in (ZeroMQ heartbeats: within 2 s), so 5 s. Measured on this 2-core shared machine,
recovery came within 0.5 s of every heal (the first window after it), most of each fault's cost falls
inside the fault itself.
"""

from __future__ import annotations

from pathlib import Path

from tiermesh.chaos.faults import Fault
from tiermesh.chaos.runner import Profile

__all__ = ["LONG", "PROFILES", "SHORT", "SMALL_TOPOLOGY"]

SMALL_TOPOLOGY = Path(__file__).resolve().parents[2] / "tests" / "data" / "topology_small.yaml"
RECOVERY_BOUND_S = 5.0

# the first fault comes 8 s in: the baseline check needs several windows of a settled mesh (with the first
# fault at 4 s it had three, and one run's 4 tight misses out of 57 read as an unhealthy mesh)
SHORT = Profile("short", duration_s=66.0, recovery_bound_s=RECOVERY_BOUND_S, faults=(
    Fault("agent_kill", 8.0, 2.0, "edge-par-1"),
    Fault("agent_stop", 20.0, 2.0, "mid-eu"),
    Fault("link_blackhole", 30.0, 3.0, "mid-eu-core-eu"),
    Fault("leader_kill", 40.0, 1.0),
    Fault("etcd_stop", 44.0, 3.0),
    Fault("burst", 52.0, 0.0, "edge-fra-1"),
    Fault("slow_site", 56.0, 3.0, "core-eu"),
))

LONG = Profile("long", duration_s=250.0, recovery_bound_s=RECOVERY_BOUND_S, faults=(
    Fault("agent_kill", 5.0, 2.0, "edge-par-1"),
    Fault("agent_stop", 17.0, 3.0, "mid-eu"),
    Fault("agent_kill", 30.0, 2.0, "core-eu"),
    Fault("link_cut", 45.0, 4.0, "edge-fra-1-mid-eu"),
    Fault("link_blackhole", 60.0, 4.0, "mid-eu-core-eu"),
    Fault("leader_kill", 75.0, 1.0),
    Fault("leader_stop", 80.0, 5.0),
    Fault("etcd_stop", 92.0, 4.0),
    Fault("etcd_kill", 105.0, 3.0),
    Fault("compaction", 120.0, 4.0, "edge-fra-1"),
    Fault("topology_link", 135.0, 8.0, "mid-eu-core-eu"),
    Fault("slow_site", 152.0, 5.0, "mid-eu"),
    Fault("corrupt_blob", 168.0, 6.0, "mid-eu"),
    Fault("load_error", 188.0, 6.0, "edge-par-1"),
    Fault("burst", 208.0, 0.0, "edge-fra-1"),
    Fault("agent_stop", 214.0, 2.0, "edge-par-1"),
    Fault("burst", 226.0, 0.0, "edge-par-1"),
    Fault("slow_site", 232.0, 4.0, "edge-fra-1"),
))

PROFILES = {p.name: p for p in (SHORT, LONG)}
