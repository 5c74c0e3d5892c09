"""Topology: the operator's description of sites, links and tenants.

``loader`` turns YAML into typed ``schema`` objects (or one precise ``TopologyError``),
``graph`` answers latency / bandwidth questions over it, ``store_io`` diffs and applies it to
etcd, ``cli`` is ``tiermesh topology ...``.
"""

from topology.graph import TopologyGraph
from topology.loader import load_topology_file, parse_topology
from topology.schema import (
    SCHEMA_VERSION,
    Gpu,
    Hardware,
    Isolation,
    Link,
    Site,
    Tenant,
    Tier,
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
    "Site",
    "Tenant",
    "Tier",
    "Topology",
    "TopologyGraph",
    "apply",
    "desired_state",
    "diff",
    "load_topology",
    "load_topology_file",
    "parse_topology",
]
