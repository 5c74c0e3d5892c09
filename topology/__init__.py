"""Topology: the operator's description of sites, links and tenants.

``loader`` turns YAML into typed ``schema`` objects (or one precise ``TopologyError``),
``paths`` is the mesh's one shortest-path computation over it (latency, bottleneck, jitter),
``store_io`` diffs and applies it to etcd. ``tiermesh topology ...`` lives in ``tiermesh/cli``.
"""

from topology.loader import load_topology_file, parse_topology
from topology.paths import LinkSpec, PathTables, shortest_paths, topology_paths
from topology.schema import (
    SCHEMA_VERSION,
    Gpu,
    Hardware,
    Isolation,
    Link,
    Site,
    Tenant,
    Topology,
)
from topology.store_io import Diff, apply, desired_state, diff, load_topology

__all__ = [
    "SCHEMA_VERSION",
    "Diff",
    "Gpu",
    "Hardware",
    "Isolation",
    "Link",
    "LinkSpec",
    "PathTables",
    "Site",
    "Tenant",
    "Topology",
    "apply",
    "desired_state",
    "diff",
    "load_topology",
    "load_topology_file",
    "parse_topology",
    "shortest_paths",
    "topology_paths",
]
