"""Which loaded variants a full site unloads to make room for one it needs: pure, no clock reads.

A site agent asks when a load does not fit its model-memory budget. The least valuable *idle*
residents go first: value is recent demand (an exponentially decayed request rate, so a variant
served steadily outranks one used once a second ago), then time idle (least recently used first),
then the larger one (fewer victims). A resident with queued or running requests, or one the caller
protects (the variant being loaded shares its backbone, say), is never a victim.

Backbones are counted once: a shared backbone's bytes come back only when every head on it is a
victim (``Resident.base`` names it, ``bases`` gives its bytes). When even every idle resident would
not make room, the answer is ``None``: refuse the load, evict nothing.

Units: bytes; ``qps`` requests per second; ``idle_s`` seconds since last use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["DEMAND_TAU_S", "Resident", "decayed_rate", "plan_eviction"]

# Time constant of the decayed request rate (``decayed_rate``): demand older than a few of these
# no longer protects a variant.
DEMAND_TAU_S = 10.0


@dataclass(frozen=True, slots=True)
class Resident:
    key: str                 # the host's name for the loaded instance
    memory_bytes: int        # its own memory (a head without its backbone)
    qps: float = 0.0         # recent demand
    idle_s: float = 0.0
    busy: bool = False       # requests queued or running: never evicted
    base: str | None = None  # the backbone instance it uses, if any


def decayed_rate(rate: float, since_s: float, tau_s: float = DEMAND_TAU_S) -> float:
    """A rate kept as ``rate`` at the last request, ``since_s`` ago, read now."""
    return rate * math.exp(-max(0.0, since_s) / tau_s)


def plan_eviction(residents: Iterable[Resident], bases: Mapping[str, int], need_bytes: int,
                  free_bytes: int, protect: Iterable[str] = ()) -> list[str] | None:
    """Keys to unload so that ``need_bytes`` fit in ``free_bytes`` plus what they free, in order;
    ``[]`` when it fits already, ``None`` when it cannot fit."""
    if need_bytes <= free_bytes:
        return []
    residents = list(residents)
    keep = set(protect)
    heads_on: dict[str, int] = {}
    for r in residents:
        if r.base is not None:
            heads_on[r.base] = heads_on.get(r.base, 0) + 1
    order = sorted((r for r in residents if not r.busy and r.key not in keep),
                   key=lambda r: (r.qps, -r.idle_s, -r.memory_bytes, r.key))
    victims: list[str] = []
    free = free_bytes
    for r in order:
        victims.append(r.key)
        free += r.memory_bytes
        if r.base is not None:
            heads_on[r.base] -= 1
            if heads_on[r.base] == 0:
                free += bases.get(r.base, 0)
        if need_bytes <= free:
            return victims
    return None
