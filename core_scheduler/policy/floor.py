"""The warm floor: what every site holds before any demand is seen, so first queries find warm
variants where each tier is good at something.

- edge sites: the smallest variant of each public task among those within
  ``edge_compute_factor`` of the fastest (memory is an edge's scarce resource; microsecond
  compute differences are within profiling noise) — tight latency is served where the caller is;
- middle sites: the most accurate variant whose compute is at most ``middle_compute_factor`` times
  the fastest — a balanced choice one short hop away;
- core sites: the most accurate variant of each task — accuracy-first traffic lands there.

Pure: a function of the snapshot only. Demand-driven placement adds to this floor, never removes it.
"""

from __future__ import annotations

from core_scheduler.policy.routing_candidates import resolve_compute
from core_scheduler.policy.snapshot import MeshSnapshot, SiteInfo, VariantInfo

__all__ = ["floor_placement"]


def _fits(site: SiteInfo, v: VariantInfo, used: int, memory_fraction: float) -> bool:
    return used + max(v.memory_bytes, v.size_bytes) <= site.memory_bytes * memory_fraction


def floor_placement(snap: MeshSnapshot, *, middle_compute_factor: float = 3.0,
                    edge_compute_factor: float = 1.5, memory_fraction: float = 0.25
                    ) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for name in sorted(snap.sites):
        site = snap.sites[name]
        hw = site.hardware_class
        chosen: list[str] = []
        used = 0
        for task in sorted(snap.variants):
            public = [v for v in snap.variants[task] if v.owner == "public" and v.runs_on(hw)]
            if not public:
                continue
            # compared at the profiles' resolution, as the router compares them
            def ms(v: VariantInfo, hw: str = hw) -> float:
                return resolve_compute(v.compute_at(hw))

            fastest = min(public, key=lambda v: (ms(v), -v.accuracy, v.variant_id))
            if site.tier == "edge":
                limit = ms(fastest) * edge_compute_factor
                pick = min((v for v in public if ms(v) <= limit),
                           key=lambda v: (v.size_bytes, ms(v), v.variant_id))
            elif site.tier == "middle":
                limit = ms(fastest) * middle_compute_factor
                pick = max((v for v in public if ms(v) <= limit),
                           key=lambda v: (v.accuracy, -ms(v), -v.size_bytes, v.variant_id))
            else:
                pick = max(public, key=lambda v: (v.accuracy, -ms(v), -v.size_bytes, v.variant_id))
            if _fits(site, pick, used, memory_fraction):
                chosen.append(pick.variant_id)
                used += max(pick.memory_bytes, pick.size_bytes)
        out[name] = tuple(chosen)
    return out
