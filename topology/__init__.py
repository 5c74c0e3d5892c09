"""Topology: the operator's description of sites, links and tenants.

``loader`` turns YAML into typed ``schema`` objects (or one precise ``TopologyError``),
``paths`` is the mesh's one shortest-path computation over it (latency, bottleneck, jitter),
``store_io`` diffs and applies it to etcd. ``tiermesh topology ...`` lives in ``tiermesh/cli``.

Names are imported on first use (PEP 562): an agent reads ``topology.paths`` and ``topology.schema`` and must not
pay for the YAML parser (``loader``) or the etcd I/O (``store_io``) it never calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mesh.lazy import lazy_exports

if TYPE_CHECKING:
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

_LAZY = {
    **dict.fromkeys(("load_topology_file", "parse_topology"), "topology.loader"),
    **dict.fromkeys(("LinkSpec", "PathTables", "shortest_paths", "topology_paths"), "topology.paths"),
    **dict.fromkeys(("SCHEMA_VERSION", "Gpu", "Hardware", "Isolation", "Link", "Site", "Tenant", "Topology"),
                    "topology.schema"),
    **dict.fromkeys(("Diff", "apply", "desired_state", "diff", "load_topology"), "topology.store_io"),
}

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


__getattr__, __dir__ = lazy_exports("topology", _LAZY, globals())
