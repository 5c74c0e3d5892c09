"""What an agent's view follows in etcd: the keys it routes on, not the whole mesh.

An agent routes each query to itself or to a site whose path round trip leaves room in the query's
budget; a site a thousand kilometres away never wins a decision an edge makes, yet following its
heartbeat costs this agent an event every time it changes. So an agent follows:

* the mesh's shared configuration (``topology/``, ``tenants/``, ``catalog/``, ``cascades/``, ``pipelines/``,
  ``services/``,
  ``pki/crl``, the sites' certificates ``pki/sites/``),
  whose size grows with the mesh but which changes only when an operator acts;
* its own ``placement/<site>``;
* the ``live/<site>`` records of its **route set**: the ``peers`` nearest sites by path round trip (ties
  by name), plus the ``per_tier`` nearest of every tier however far (so an edge always sees some core
  sites to fall back on), plus itself.

A mesh of at most ``peers + 1`` sites is followed whole, so small meshes behave as before. The other sites
look dead to routing (no heartbeat): they are never chosen. The route set changes only with the topology
(the view recomputes it then). The live keys are watched as a few key *ranges*: consecutive names of the
route set (in the sorted order of every site name) share one range, so region-prefixed names cost a handful
of etcd watchers per agent.

The scheduler follows everything (``scope=None``): placement needs every site's heartbeat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mesh.etcd.keys import (
    CASCADES,
    CATALOG,
    LIVE,
    PIPELINES,
    PKI_CRL,
    PKI_SITES,
    SERVICES,
    TENANTS,
    TOPOLOGY_META,
    live_key,
    placement_key,
)
from mesh.etcd.watch import KeyRange
from topology.paths import topology_paths
from topology.schema import Topology

__all__ = ["Scope", "live_ranges", "route_set", "view_ranges"]


@dataclass(frozen=True, slots=True)
class Scope:
    """An agent's route set parameters: ``peers`` nearest sites, the ``per_tier`` nearest of each tier."""

    here: str
    peers: int = 48
    per_tier: int = 2

    def __post_init__(self) -> None:
        if self.peers < 0 or self.per_tier < 0:
            raise ValueError(f"route set sizes must be >= 0, got peers={self.peers} per_tier={self.per_tier}")


def route_set(topology: Topology, scope: Scope) -> frozenset[str]:
    """The sites ``scope.here`` routes on (see the module docstring); every site when the mesh is small or
    ``here`` is not in it."""
    names = topology.sites
    if scope.here not in names or len(names) <= scope.peers + 1:
        return frozenset(names)
    paths = topology_paths(topology)  # cached by content: computed once per topology, not per agent
    row = paths.latency_ms[paths.index[scope.here]]
    reachable = sorted((float(row[i]), n) for n, i in paths.index.items() if math.isfinite(row[i]))
    others = [n for _, n in reachable if n != scope.here]
    chosen = {scope.here, *others[:scope.peers]}
    by_tier: dict[str, int] = {}
    for n in others:
        tier = names[n].tier
        if by_tier.get(tier, 0) < scope.per_tier:
            by_tier[tier] = by_tier.get(tier, 0) + 1
            chosen.add(n)
    return frozenset(chosen)


def live_ranges(route: frozenset[str], all_sites: list[str] | tuple[str, ...]) -> list[KeyRange]:
    """``live/<site>`` of every site of ``route`` as key ranges: each run of consecutive names (in the
    sorted order of ``all_sites``) is one range, a lone name one key."""
    out: list[KeyRange] = []
    run: list[str] = []

    def close() -> None:
        if len(run) == 1:
            out.append(KeyRange.key(live_key(run[0])))
        elif run:
            # every key from the first name up to and including the last ("\0" sorts right after it)
            out.append(KeyRange(live_key(run[0]), live_key(run[-1]) + "\0"))
        run.clear()

    for name in sorted(all_sites):
        if name in route:
            run.append(name)
        else:
            close()
    close()
    return out


# cascades/ sorts just before catalog/ and no key lies between: one range for both ("0" follows "/")
_CATALOG_AND_CASCADES = KeyRange(CASCADES, CATALOG[:-1] + "0")


def view_ranges(topology: Topology | None, scope: Scope) -> tuple[KeyRange, ...]:
    """Every key range an agent's view follows; before a topology is known, every live record."""
    fixed = (KeyRange.under(TOPOLOGY_META.split("/")[0] + "/"), KeyRange.under(TENANTS), _CATALOG_AND_CASCADES,
             KeyRange.under(PIPELINES), KeyRange.under(SERVICES), KeyRange.key(PKI_CRL), KeyRange.under(PKI_SITES),
             KeyRange.key(placement_key(scope.here)))
    if topology is None:
        return (*fixed, KeyRange.under(LIVE))
    return (*fixed, *live_ranges(route_set(topology, scope), tuple(topology.sites)))
