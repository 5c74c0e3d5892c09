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
modes exist. The baselines (and the placement policy they call) are imported only when a baseline is
named: an agent routing as tiermesh never loads them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from core_scheduler.policy.routing import Decision, Query, RoutingTable
from core_scheduler.policy.snapshot import MeshSnapshot
from mesh.errors import ConfigError

__all__ = ["Placer", "Router", "make_router", "mode_names", "placer_for"]


class Router(Protocol):
    def decide(self, q: Query) -> Decision: ...


RouterFactory = Callable[[MeshSnapshot, str], Router]
# (snapshot, floor placement, demand-driven plan) -> per-site variant ids, or None to keep tiermesh's
Placer = Callable[[MeshSnapshot, dict[str, tuple[str, ...]], dict[str, tuple[str, ...]], Any],
                  dict[str, tuple[str, ...]]]

TIERMESH = "tiermesh"


def _registry() -> tuple[dict[str, RouterFactory], dict[str, Placer]]:
    from core_scheduler.policy import baselines

    return {TIERMESH: RoutingTable.build, **baselines.ROUTERS}, dict(baselines.PLACERS)


def mode_names() -> list[str]:
    return sorted(_registry()[0])


def make_router(mode: str, snap: MeshSnapshot, here: str) -> Router:
    if mode == TIERMESH:
        return RoutingTable.build(snap, here)
    routers, _ = _registry()
    try:
        factory = routers[mode]
    except KeyError as exc:
        raise ConfigError(f"unknown routing mode {mode!r}; known: {sorted(routers)}") from exc
    return factory(snap, here)


def placer_for(mode: str) -> Placer | None:
    routers, placers = _registry()
    if mode not in routers:
        raise ConfigError(f"unknown mode {mode!r}; known: {sorted(routers)}")
    return placers.get(mode)
