"""How a tenant's global quota is shared across the doors of the mesh: a pure function over the
cluster view's heartbeats.

The topology gives each tenant ``quotas: {qps, max_inflight}`` for the whole mesh. Every agent
fronts callers (HTTP, SDK) and charges a query once, at the door where it entered; forwarded hops
are not charged again (:mod:`edge_agent.quota`).

* ``qps`` is **global** and split between the doors by demand. Door ``s`` enforces
  ``qps x share(s)`` with a token bucket, where::

      share(s) = FLOOR / n + (1 - FLOOR) * d(s) / D        (D > 0; 1 / n when D == 0)

  ``n`` is the number of doors (the live sites in the view, plus this one), ``d(s)`` the tenant's
  queries per second that ``s`` admitted at its door over its last demand window (the
  ``DemandSample`` records of its heartbeat, summed over tasks and SLO classes) and ``D`` the sum over
  doors. Every door computes from the same heartbeats, so the shares add up to 1 and the mesh
  admits at most ``qps`` (give or take one heartbeat of staleness). ``FLOOR`` reserves a slice
  (``FLOOR / n`` each) so that a door with no recent demand (a new edge, a quiet one) can admit
  queries and so be seen to have demand; the rest follows demand, re-computed whenever the view
  changes (each heartbeat). A door whose tenant is capped grows its share as its admitted demand
  shows in its heartbeats. The cost: up to ``FLOOR x qps`` of the global quota sits at doors that
  do not use it.
* ``max_inflight`` is **per door**: each door admits at most that many of the tenant's queries at
  once. A concurrency cap protects that door's own queues; splitting it by demand would starve a
  door of concurrency before its heartbeats caught up with a burst.

**A door's published demand is clamped** to ``[0, qps]`` (and a value that is not a finite number counts as
none): the heartbeat is written by the door itself, and a compromised door publishing a huge demand would
otherwise take ``(1 - FLOOR)`` of the tenant's quota from every other door, leaving each ``FLOOR / n``. Why the
tenant's ``qps`` and not the share the door was allowed: a door admits at most its bucket's rate (and burst), which
stays below ``qps`` (a share is at most ``FLOOR / n + 1 - FLOOR``), so no honest door publishes more and the clamp
costs honest doors nothing; a cap at the door's previous share would need the previous round's shares (this
policy is a pure function of one snapshot), and a liar would climb it a heartbeat at a time to the same fixed point
anyway. With the clamp, a door ``h`` whose tenant's honest doors admit ``D_h <= qps`` in all keeps, whatever one
liar publishes::

    share(h) >= FLOOR / n + (1 - FLOOR) * d(h) / (qps + D_h) >= FLOOR / n + (1 - FLOOR) * d(h) / (2 * qps)

not ``FLOOR / n``: when the honest doors' demand fills the quota, the liar takes at most half of the part shared by
demand.

A missing key means no limit of that kind; ``0`` refuses every query of the tenant.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["BURST_S", "FLOOR", "QuotaLimit", "clamp_demand", "door_limits", "qps_share"]

FLOOR = 0.2     # fraction of a tenant's global qps kept evenly across doors, so an idle door can start
BURST_S = 1.0   # a door's bucket holds this many seconds of its rate (at least one token)


@dataclass(frozen=True, slots=True)
class QuotaLimit:
    """What one door enforces for one tenant. ``None``: no limit of that kind."""

    qps: float | None = None          # token refill rate, queries/s
    burst: float = 1.0                # bucket capacity, queries
    max_inflight: int | None = None   # concurrent queries admitted at this door


def clamp_demand(qps: object, cap: float = math.inf) -> float:
    """A door's published demand as believed: within ``[0, cap]``; anything but a finite number counts as 0."""
    if not isinstance(qps, int | float) or isinstance(qps, bool) or not math.isfinite(qps) or qps <= 0.0:
        return 0.0
    return min(float(qps), cap)


def qps_share(here: str, doors: Iterable[str], demand: Mapping[str, float], floor: float = FLOOR,
              cap: float = math.inf) -> float:
    """The fraction of a tenant's global qps that door ``here`` enforces (see the module docstring).
    ``demand``: the tenant's admitted qps per door (missing doors: 0), each clamped to ``[0, cap]`` (the tenant's
    ``qps``: no door can have admitted more)."""
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be within [0, 1], got {floor}")
    names = set(doors) | {here}
    n = len(names)
    believed = {s: clamp_demand(demand.get(s, 0.0), cap) for s in names}
    total = sum(believed.values())
    if total <= 0.0:
        return 1.0 / n
    return floor / n + (1.0 - floor) * believed[here] / total


def door_limits(here: str, doors: Iterable[str], quotas: Mapping[str, Mapping[str, float]],
                demand: Mapping[str, Mapping[str, float]], *, floor: float = FLOOR,
                burst_s: float = BURST_S) -> dict[str, QuotaLimit]:
    """Per tenant with quotas, what door ``here`` enforces.

    ``quotas``: tenant -> its topology quotas (``qps``, ``max_inflight``); ``demand``: door ->
    tenant -> admitted qps in that door's last window (from the heartbeats). Tenants without quotas
    are left out (no limit)."""
    names = frozenset(doors) | {here}
    out: dict[str, QuotaLimit] = {}
    for tenant, q in quotas.items():
        if not q:
            continue
        rate: float | None = None
        burst = 1.0
        if (g := q.get("qps")) is not None:
            rate = float(g) * qps_share(here, names, {s: demand.get(s, {}).get(tenant, 0.0) for s in names},
                                        floor, cap=float(g))
            burst = max(1.0, rate * burst_s) if rate > 0 else 0.0
        inflight = q.get("max_inflight")
        out[tenant] = QuotaLimit(qps=rate, burst=burst,
                                 max_inflight=None if inflight is None else math.floor(inflight))
    return out
