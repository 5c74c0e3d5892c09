"""Routing and placement *modes*: tiermesh itself and the baselines it is measured against.

A mode names a router factory (per-query decisions at the receiving agent) and, optionally, a
placement override for the scheduler. ``tiermesh`` is the real policy; the others exist so the
benchmarks can run every system on the same trace, harness and code path:

- ``edge-only``   every query served at its edge by what fits there;
- ``core-only``   every query shipped to the core's best variant;
- ``static``      one fixed variant per task everywhere (a pinned Triton-style deployment);
- ``infaas``      cheapest variant meeting the SLO, chosen without network-path awareness,
                  reactive scaling only.

Implementations of the baselines live in ``core_scheduler.policy.baselines``; this module joins
them with tiermesh's own into one registry, so the agent and the scheduler need not know which
modes exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from core_scheduler.policy import baselines
from core_scheduler.policy.routing import Decision, Query, RoutingTable
from core_scheduler.policy.snapshot import MeshSnapshot
from mesh.errors import ConfigError

__all__ = ["PLACERS", "ROUTERS", "Placer", "Router", "make_router", "mode_names", "placer_for"]


class Router(Protocol):
    def decide(self, q: Query) -> Decision: ...


RouterFactory = Callable[[MeshSnapshot, str], Router]
# (snapshot, floor placement, demand-driven plan) -> per-site variant ids, or None to keep tiermesh's
Placer = Callable[[MeshSnapshot, dict[str, tuple[str, ...]], dict[str, tuple[str, ...]], Any],
                  dict[str, tuple[str, ...]]]

ROUTERS: dict[str, RouterFactory] = {"tiermesh": RoutingTable.build, **baselines.ROUTERS}
PLACERS: dict[str, Placer] = {**baselines.PLACERS}


def mode_names() -> list[str]:
    return sorted(ROUTERS)


def make_router(mode: str, snap: MeshSnapshot, here: str) -> Router:
    try:
        factory = ROUTERS[mode]
    except KeyError as exc:
        raise ConfigError(f"unknown routing mode {mode!r}; known: {sorted(ROUTERS)}") from exc
    return factory(snap, here)


def placer_for(mode: str) -> Placer | None:
    if mode not in ROUTERS:
        raise ConfigError(f"unknown mode {mode!r}; known: {sorted(ROUTERS)}")
    return PLACERS.get(mode)
