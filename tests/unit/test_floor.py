"""The warm floor puts fast variants at the edge and accurate ones at the core."""

import pytest

from core_scheduler.policy.floor import floor_placement
from core_scheduler.policy.snapshot import MeshSnapshot, SiteInfo, VariantInfo

pytestmark = pytest.mark.unit
HW = "cpu-x86_64"


def _v(vid: str, acc: float, ms: float, size: int = 1000, owner: str = "public") -> VariantInfo:
    return VariantInfo(task="t", variant_id=vid, accuracy=acc, size_bytes=size, owner=owner,
                       compute_ms={HW: {1: ms}}, load_ms={HW: 5.0}, memory_bytes=size)


def _snap(edge_mem_mb: int = 1024) -> MeshSnapshot:
    sites = [SiteInfo("e", "edge", "r", HW, 2, edge_mem_mb), SiteInfo("m", "middle", "r", HW, 8, 8192),
             SiteInfo("c", "core", "r", HW, 32, 65536)]
    variants = [_v("tiny.int8", 0.95, 0.05, size=400), _v("tiny.fp32", 0.95, 0.045, size=1000),
                _v("small", 0.975, 0.12), _v("large", 0.987, 0.9),
                _v("private", 0.999, 0.01, owner="acme")]
    return MeshSnapshot.from_parts(sites, variants, links=[("e", "m", 3, 1000), ("m", "c", 20, 10000)])


def test_tiers_get_their_strengths() -> None:
    plan = floor_placement(_snap())
    assert plan["e"] == ("tiny.int8",)  # smallest within 1.5x of the fastest, not the fastest
    assert plan["m"] == ("small",)      # most accurate within 3x the fastest compute
    assert plan["c"] == ("large",)      # most accurate public variant; private ones never floored


def test_memory_limit_respected() -> None:
    sites = [SiteInfo("e", "edge", "r", HW, 2, 1)]  # 1 MB site, 25 % for models = 256 KiB
    snap = MeshSnapshot.from_parts(sites, [_v("big", 0.9, 0.1, size=10 << 20)])
    assert floor_placement(snap)["e"] == ()
