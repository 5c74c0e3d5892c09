"""Versions of a tenant's task (issue 34 item 3): the version choice, the weighted draw, the retirement rules,
the hostile decoding of the records, and routing's version filter over a real routing table."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from core_scheduler.policy.routing import Query, RoutingTable
from core_scheduler.policy.snapshot import MeshSnapshot, SiteInfo, SiteLoad, VariantInfo
from core_scheduler.policy.versions import pick_version, version_shares
from mesh.errors import NoRoute, UnknownTask
from variant_store.meta import VariantMeta
from variant_store.versions import (
    ModelOp,
    VersionInfo,
    VersionRecord,
    due_retirements,
    next_version,
    normalise_weights,
    required_accuracy,
    shares_of,
)

pytestmark = pytest.mark.unit


def _rec(active: int = 1, weights: dict[int, float] | None = None, **states: tuple[str, float, float]
         ) -> VersionRecord:
    versions = {int(k[1:]): VersionInfo(f"fam{k[1:]}", s, a, at) for k, (s, a, at) in states.items()}  # type: ignore[arg-type]
    return VersionRecord("t", "acme", active, versions, weights or {})


# (shares, pin, draw, expected)
PICKS = [
    ({1: 1.0}, None, 0.99, 1),
    ({1: 1.0, 2: 0.0}, None, 0.5, 1),          # a building version draws nothing
    ({1: 0.0, 2: 1.0}, None, 0.0, 2),          # moved
    ({1: 0.9, 2: 0.1}, None, 0.89, 1),
    ({1: 0.9, 2: 0.1}, None, 0.91, 2),
    ({1: 0.0, 2: 1.0}, 1, 0.5, 1),             # a pin wins over the split
]


@pytest.mark.parametrize(("shares", "pin", "draw", "want"), PICKS)
def test_pick_version(shares: dict[int, float], pin: int | None, draw: float, want: int) -> None:
    assert pick_version("t", shares, pin, draw) == want


def test_a_pin_of_a_version_the_task_lacks_is_unknown() -> None:
    with pytest.raises(UnknownTask, match="no version 3"):
        pick_version("t", {1: 1.0, 2: 0.0}, 3, 0.5)


@pytest.mark.parametrize("shares", [{1: 0.0}, {1: 0.0, 2: 0.0}])
def test_no_version_taking_traffic_is_no_route_but_a_pin_is_served(shares: dict[int, float]) -> None:
    """Every version held (below the task's declared accuracy) or building: nothing is served unless pinned."""
    with pytest.raises(NoRoute, match="no version taking traffic"):
        pick_version("t", shares, None, 0.3)
    assert pick_version("t", shares, 1, 0.3) == 1


@pytest.mark.parametrize("weights", [{1: 0.5, 2: 0.5}, {1: 0.9, 2: 0.1}, {1: 0.2, 2: 0.3, 3: 0.5}])
def test_seeded_draws_hit_the_weights(weights: dict[int, float]) -> None:
    rng = random.Random(7)
    n = 20_000
    got = Counter(pick_version("t", weights, None, rng.random()) for _ in range(n))
    for v, w in weights.items():
        assert abs(got[v] / n - w) < 0.02, (v, got)


def test_version_numbers_and_the_accuracy_to_meet() -> None:
    assert next_version(None) == 1
    rec = _rec(2, v1=("retired", 0.9, 0), v2=("active", 0.93, 0), v3=("failed", 0, 0))
    assert next_version(rec) == 4  # a failed or retired number is never reused
    assert required_accuracy(rec) == 0.93 and required_accuracy(None) == 0.0
    assert required_accuracy(VersionRecord("t", "acme")) == 0.0
    assert shares_of(rec) == {2: 1.0}
    assert shares_of(rec.but(weights={1: 0.5, 2: 0.5})) == {1: 0.5, 2: 0.5}


# (record, now, retired)
RETIRE = [
    (_rec(2, v1=("retiring", 0.9, 100.0), v2=("active", 0.9, 0)), 99.0, []),     # grace not over
    (_rec(2, v1=("retiring", 0.9, 100.0), v2=("active", 0.9, 0)), 100.0, [1]),
    (_rec(2, {1: 0.5, 2: 0.5}, v1=("retiring", 0.9, 100.0), v2=("active", 0.9, 0)), 500.0, []),  # a split waits
    (_rec(2, {2: 1.0}, v1=("retiring", 0.9, 100.0), v2=("active", 0.9, 0)), 500.0, [1]),
    (_rec(2, v1=("held", 0.5, 0), v2=("active", 0.9, 0)), 500.0, []),           # held stays
]


@pytest.mark.parametrize(("rec", "now", "want"), RETIRE)
def test_retirement(rec: VersionRecord, now: float, want: list[int]) -> None:
    assert due_retirements(rec, now) == want


def test_weights_are_checked_and_normalised() -> None:
    rec = _rec(2, v1=("retiring", 0.9, 100.0), v2=("active", 0.9, 0), v3=("failed", 0, 0))
    assert normalise_weights(rec, {2: 1.0, 1: 1.0}) == {1: 0.5, 2: 0.5}
    assert normalise_weights(rec, {2: 3.0, 1: 0.0}) == {2: 1.0}
    for bad, why in (({}, "one version"), ({3: 1.0}, "no servable version 3"), ({9: 1.0}, "no servable"),
                     ({1: -1.0}, ">= 0"), ({1: float("nan")}, ">= 0"), ({1: 0.0}, "above 0")):
        with pytest.raises(ValueError, match=why):
            normalise_weights(rec, bad)


def test_records_round_trip_and_refuse_hostile_values() -> None:
    rec = _rec(2, {1: 0.25, 2: 0.75}, v1=("retiring", 0.9, 100.0), v2=("active", 0.93, 0))
    assert VersionRecord.from_json(rec.to_json()) == rec
    op = ModelOp("abc", "acme", "t", "traffic", {2: 0.1, 1: 0.9}, created=5.0)
    assert ModelOp.from_json(op.to_json()) == op
    good = rec.to_json()
    for change in ({"active": 7}, {"active": True}, {"versions": {"x": {}}}, {"versions": {"0": {}}},
                   {"versions": {"1": {"family": "f", "state": "zombie"}}}, {"weights": {"1": 2.0}},
                   {"weights": {"1": "a"}}, {"task": ""}, {"owner": 5}, {"versions": []}):
        with pytest.raises(ValueError):
            VersionRecord.from_json({**good, **change})
    for change in ({"op": "drop"}, {"state": "maybe"}, {"tenant": None}, {"weights": {"-1": 1}}):
        with pytest.raises(ValueError):
            ModelOp.from_json({**op.to_json(), **change})


def test_a_variant_entry_carries_its_version_with_a_default_and_refuses_bad_ones() -> None:
    meta = VariantMeta(task="t", family="f", variant_id="f.onnx.fp32", format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest="0" * 64, size_bytes=10, accuracy=0.9)
    old = meta.to_json()
    del old["version"], old["share"]
    assert (VariantMeta.from_json(old).version, VariantMeta.from_json(old).share) == (1, 1.0)  # written before
    assert VariantMeta.from_json({**old, "version": 3, "share": 0.0}).version == 3
    for bad in ({"version": 0}, {"version": "2"}, {"version": True}, {"share": 1.5}, {"share": float("nan")}):
        with pytest.raises(ValueError):
            VariantMeta.from_json({**old, **bad})


# -- routing's version filter over a real routing table --------------------------------------------------------
def _snap(shares: dict[int, float]) -> MeshSnapshot:
    sites = [SiteInfo("edge", "edge", "eu", "cpu", 4, 2048, 0, 0.036), SiteInfo("core", "core", "eu", "cpu", 16,
                                                                              32768, 0, 1.44)]
    base = VariantInfo("t", "f1.onnx.fp32", 0.9, 1 << 20, owner="acme", compute_ms={"cpu": {1: 1.0}},
                       load_ms={"cpu": 10.0}, memory_bytes=1 << 20)
    vs = [dataclasses.replace(base, variant_id=f"f{n}.onnx.fp32", version=n, share=s,
                              compute_ms={"cpu": {1: 1.0 + n}}) for n, s in shares.items()]
    loads = [SiteLoad(s.name, loaded=frozenset(v.variant_id for v in vs), capacity=4, memory_free_bytes=1 << 30)
             for s in sites]
    return MeshSnapshot.from_parts(sites, vs, loads, [("edge", "core", 5.0, 100.0)], version=1)


def test_routing_filters_candidates_to_the_drawn_or_pinned_version() -> None:
    moved = RoutingTable.build(_snap({1: 0.0, 2: 1.0}), "edge", seed=1)
    for _ in range(50):  # traffic moved: every query to version 2, though version 1 is cheaper
        assert moved.decide(Query("t", "acme")).variant_id == "f2.onnx.fp32"
    assert moved.decide(Query("t", "acme", version=1)).variant_id == "f1.onnx.fp32"
    with pytest.raises(UnknownTask):
        moved.decide(Query("t", "acme", version=5))
    with pytest.raises(UnknownTask):  # another tenant: unknown, pinned or not
        moved.decide(Query("t", "globex", version=1))
    split = RoutingTable.build(_snap({1: 0.5, 2: 0.5}), "edge", seed=3)
    got = Counter(split.decide(Query("t", "acme")).variant_id for _ in range(2000))
    assert abs(got["f1.onnx.fp32"] / 2000 - 0.5) < 0.05, got
    assert version_shares(_snap({1: 0.5, 2: 0.5}).variants["t"]) == {1: 0.5, 2: 0.5}


def test_a_task_of_one_version_routes_as_before_and_answers_a_pin_of_it() -> None:
    one = RoutingTable.build(_snap({1: 1.0}), "edge")
    assert one.decide(Query("t", "acme")).variant_id == "f1.onnx.fp32"
    assert one.decide(Query("t", "acme", version=1)).variant_id == "f1.onnx.fp32"
    with pytest.raises(UnknownTask):
        one.decide(Query("t", "acme", version=2))
    later = RoutingTable.build(_snap({3: 1.0}), "edge")  # versions 1 and 2 retired
    assert later.decide(Query("t", "acme")).variant_id == "f3.onnx.fp32"
    assert later.decide(Query("t", "acme", version=3)).variant_id == "f3.onnx.fp32"
