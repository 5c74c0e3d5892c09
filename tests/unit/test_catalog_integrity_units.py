"""Issue 34, item 0: one bad catalog entry never breaks the mesh (the pure parts).

Variant ids are unique across the mesh, so a family belongs to one task (:func:`family_conflict`,
:func:`id_conflict`); a duplicate that reaches etcd anyway is settled the same way by every reader (the claim made
first wins: :func:`winners`), and the view holds only the winner, reporting the rest in ``rejected``; catalog
values are decoded as hostile input (``ValueError`` alone, whatever etcd holds).
"""

from __future__ import annotations

from typing import Any, cast

import pytest

from core_scheduler.state.view_state import ViewState
from mesh.errors import ProtocolError
from mesh.etcd.keys import MODELS, catalog_key
from mesh.etcd.ops import KV
from mesh.etcd.store import Store, Undecodable, decode_json
from tests.unit.test_hostile_values import HOSTILE, _python_hostile
from variant_store.catalog import Catalog, RegisteredModel, decode_variant
from variant_store.catalog_check import Claim, family_conflict, id_conflict, winners
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.unit

DIGITS, MINE = "digit-classification", "my-digits"
VID = "mlp-tiny.onnx.fp16"


def _meta(task: str, vid: str = VID, **over: Any) -> VariantMeta:
    fields: dict[str, Any] = dict(task=task, family=vid.split(".")[0], variant_id=vid, format="onnx",
                                  precision="fp16", runtime="onnxruntime", blob_digest="a" * 64, size_bytes=10,
                                  accuracy=0.97)
    fields.update(over)
    return VariantMeta(**fields)


# -- collisions refused at registration -----------------------------------------------------------------------

@pytest.mark.parametrize(("task", "family", "models", "variants", "holder"), [
    # the issue's sequence: my-digits reusing digit-classification's mlp-tiny
    (MINE, "mlp-tiny", [(DIGITS, "mlp-tiny", 3)], [(DIGITS, "mlp-tiny", VID, 4)], DIGITS),
    (MINE, "mlp-tiny", [], [(DIGITS, "mlp-tiny", VID, 4)], DIGITS),              # catalogued, registration gone
    (MINE, "mlp-tiny", [(DIGITS, "mlp-tiny", 3)], [], DIGITS),                   # registered, not built yet
    (MINE, "mlp-tiny", [], [(DIGITS, "other", "mlp-tiny.onnx.fp32", 4)], DIGITS),  # an id in the family's space
    (DIGITS, "mlp-tiny", [(DIGITS, "mlp-tiny", 3)], [(DIGITS, "mlp-tiny", VID, 4)], None),  # a re-register
    (MINE, "my-mlp", [(DIGITS, "mlp-tiny", 3)], [(DIGITS, "mlp-tiny", VID, 4)], None),
    (MINE, "mlp", [], [(DIGITS, "mlp-tiny", VID, 4)], None),                     # a prefix of a name is no clash
    # a colliding registration that slipped in before the check: the first holder still rebuilds its own,
    # and the late one is still refused
    (DIGITS, "mlp-tiny", [(DIGITS, "mlp-tiny", 3), (MINE, "mlp-tiny", 90)], [(DIGITS, "mlp-tiny", VID, 4)], None),
    (MINE, "mlp-tiny", [(DIGITS, "mlp-tiny", 3), (MINE, "mlp-tiny", 90)], [(DIGITS, "mlp-tiny", VID, 4)], DIGITS),
])
def test_family_conflict(task: str, family: str, models: list[tuple[str, str, int]],
                         variants: list[tuple[str, str, str, int]], holder: str | None) -> None:
    why = family_conflict(task, family, models, variants)
    if holder is None:
        assert why is None
    else:
        assert why is not None and repr(holder) in why and repr(family) in why
        assert f"tiermesh variants remove --task {holder} --family {family}" in why  # what to do


def test_id_conflict() -> None:
    assert id_conflict(MINE, VID, [(DIGITS, VID)]) is not None
    assert id_conflict(DIGITS, VID, [(DIGITS, VID)]) is None
    assert id_conflict(MINE, VID, [(DIGITS, "mlp-tiny.onnx.fp32")]) is None


@pytest.mark.parametrize(("claims", "kept"), [
    ([Claim(DIGITS, VID, 5), Claim(MINE, VID, 9)], DIGITS),
    ([Claim(MINE, VID, 9), Claim(DIGITS, VID, 5)], DIGITS),   # order of arrival does not matter
    ([Claim("a-first", VID, 9), Claim(DIGITS, VID, 5)], DIGITS),  # nor the task's name, when revisions differ
    ([Claim(MINE, VID, 0), Claim(DIGITS, VID, 0)], DIGITS),   # revisions unknown: the least task name
])
def test_winners(claims: list[Claim], kept: str) -> None:
    assert winners(claims)[VID].task == kept


# -- the view holds one claim per id -------------------------------------------------------------------------

def test_view_keeps_the_first_claim_and_reports_the_other() -> None:
    state = ViewState()
    assert state.put(catalog_key(DIGITS, VID), _meta(DIGITS).to_json(), 5) == "variant"
    other = catalog_key(MINE, VID)
    outcome = state.put(other, _meta(MINE).to_json(), 9)
    assert isinstance(outcome, ProtocolError) and repr(DIGITS) in outcome.message
    assert state.variants[DIGITS][VID].task == DIGITS and VID not in state.variants.get(MINE, {})
    assert other in state.rejected and not state.take_displaced()
    # an unrelated variant of the intruding task is served
    assert state.put(catalog_key(MINE, "my-mlp.onnx.fp32"), _meta(MINE, "my-mlp.onnx.fp32").to_json(), 10) \
        == "variant"
    assert set(state.variants[MINE]) == {"my-mlp.onnx.fp32"}
    # the first claim removed: the id is unique again and the other entry is served
    assert state.delete(catalog_key(DIGITS, VID), 11) == "variant"
    assert state.variants[MINE][VID].task == MINE and other not in state.rejected
    assert VID not in state.variants[DIGITS]


def test_view_settles_by_create_revision_whatever_the_order_of_a_full_read() -> None:
    """A full read comes in key order: an intruder whose task sorts first arrives first, and is pushed aside
    (and reported) when the entry created before it arrives."""
    state = ViewState()
    early = catalog_key("a-intruder", VID)
    assert state.put(early, _meta("a-intruder").to_json(), 30, created=30) == "variant"
    assert state.put(catalog_key(DIGITS, VID), _meta(DIGITS).to_json(), 40, created=3) == "variant"
    assert state.variants[DIGITS][VID].task == DIGITS and VID not in state.variants["a-intruder"]
    [(key, exc)] = state.take_displaced()
    assert key == early and early in state.rejected and repr(DIGITS) in exc.message
    # the served entry updated (a rebuild): it keeps the id, its creation is what counts
    assert state.put(catalog_key(DIGITS, VID), _meta(DIGITS, accuracy=0.5).to_json(), 50) == "variant"
    assert state.variants[DIGITS][VID].accuracy == 0.5 and early in state.rejected


def test_a_refused_update_keeps_the_last_good_claim() -> None:
    before = ViewState()
    before.put(catalog_key(DIGITS, VID), _meta(DIGITS).to_json(), 5, created=5)
    after = ViewState()
    assert isinstance(after.put(catalog_key(DIGITS, VID), {"broken": True}, 6, before=before), ProtocolError)
    assert after.variants[DIGITS][VID].task == DIGITS and catalog_key(DIGITS, VID) in after.rejected


# -- catalog values are hostile input ----------------------------------------------------------------------

def _hostile_values() -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for name, raw in HOSTILE.items():
        try:
            out.append((name, decode_json(raw)))
        except ProtocolError:
            continue  # the store hands readers an Undecodable for these: tested as one below
    out += list(_python_hostile().items())
    good = _meta(DIGITS).to_json()
    out += [("task-mismatch", {**good, "task": MINE}), ("id-mismatch", {**good, "variant_id": "x.onnx.fp32"}),
            ("accuracy-inf", {**good, "accuracy": float("inf")}), ("size-huge", {**good, "size_bytes": 10**400}),
            ("profiles-deep", {**good, "profiles": _python_hostile()["deep"]})]
    return out


@pytest.mark.parametrize(("name", "value"), _hostile_values(), ids=lambda x: x if isinstance(x, str) else "")
def test_variant_decode_raises_value_error_only(name: str, value: Any) -> None:
    with pytest.raises(ValueError):
        decode_variant(catalog_key(DIGITS, VID), value)
    state = ViewState()
    assert isinstance(state.put(catalog_key(DIGITS, VID), value, 1), ProtocolError)
    assert not state.variants.get(DIGITS)


@pytest.mark.parametrize(("name", "value"), [*_hostile_values(), ("bool-schema", {
    "task": DIGITS, "family": "f", "parent_digest": "a", "validation_digest": "b", "schema": True}),
    ("missing", {"task": DIGITS}), ("digest-list", {"task": DIGITS, "family": "f", "parent_digest": ["a"],
                                                     "validation_digest": "b"})],
    ids=lambda x: x if isinstance(x, str) else "")
def test_registered_model_decode_raises_value_error_only(name: str, value: Any) -> None:
    with pytest.raises(ValueError):
        RegisteredModel.from_json(value)


def test_good_values_still_decode() -> None:
    meta = _meta(DIGITS)
    assert decode_variant(catalog_key(DIGITS, VID), meta.to_json()) == meta
    model = RegisteredModel(DIGITS, "mlp-tiny", "a" * 64, "b" * 64, base_digest=None)
    assert RegisteredModel.from_json({**model.to_json(), "newer_field": 1}) == model


# -- the catalog's own reads (CLI, the store's HTTP catalog, `tiermesh up`) are as tolerant -------------------

class _Prefixed:
    """What ``Catalog`` asks of a store to read: ``get_prefix`` over fixed key-values (strictly a read)."""

    def __init__(self, items: list[KV]) -> None:
        self.items = items

    async def get_prefix(self, prefix: str) -> list[KV]:
        return [kv for kv in self.items if kv.key.startswith(prefix)]


def _kv(key: str, value: Any, created: int) -> KV:
    return KV(key, value, created, created, 0)


async def test_catalog_read_skips_and_reports_every_bad_entry() -> None:
    hostile = _hostile_values()
    items = [_kv(catalog_key(DIGITS, VID), _meta(DIGITS).to_json(), 3),
             _kv(catalog_key(MINE, VID), _meta(MINE).to_json(), 9),            # the duplicate, catalogued later
             _kv(catalog_key(MINE, "my-mlp.onnx.fp32"), _meta(MINE, "my-mlp.onnx.fp32").to_json(), 10),
             _kv(catalog_key(MINE, "_task"), {"task": MINE, "inputs": "x"}, 11),
             _kv(catalog_key(MINE, "undecodable"), Undecodable("not JSON", 3), 12),
             _kv("catalog/a/b/c", _meta(DIGITS).to_json(), 13)]                 # a key no entry has
    items += [_kv(catalog_key(MINE, f"h{i}"), value, 20 + i) for i, (_, value) in enumerate(hostile)]
    items += [_kv(f"{MODELS}{MINE}/bad", {"task": MINE, "family": ["x"]}, 90),
              _kv(f"{MODELS}{DIGITS}/mlp-tiny", RegisteredModel(DIGITS, "mlp-tiny", "a", "b").to_json(), 2)]
    catalog = Catalog(cast(Store, _Prefixed(items)))
    reading = await catalog.read()
    assert [(m.task, m.variant_id) for m in reading.variants] == [(DIGITS, VID), (MINE, "my-mlp.onnx.fp32")]
    broken = {b.key: b.reason for b in reading.broken}
    assert len(broken) == 4 + len(hostile)
    assert repr(DIGITS) in broken[catalog_key(MINE, VID)] and "signature" in broken[catalog_key(MINE, "_task")]
    assert [m.variant_id for m in await catalog.list_variants(MINE)] == ["my-mlp.onnx.fp32"]
    assert await catalog.list_tasks() == []
    assert [m.family for m in await catalog.list_models()] == ["mlp-tiny"]
    assert [b.key for b in await catalog.broken_models()] == [f"{MODELS}{MINE}/bad"]


def test_placement_drops_a_variant_taken_out_of_the_catalog() -> None:
    """The last placement still names a removed variant; the plan of the next round does not (and never raises)."""
    from core_scheduler.policy.placement import plan_placement
    from tests.unit.test_placement import NOW, snap

    s = snap({"edge-a": {"tiny.int8", "removed.fp32"}, "core": {"removed.fp32"}})
    p = plan_placement(s, [], NOW, {}, {})
    assert "removed.fp32" not in {v for vs in p.per_site.values() for v in vs}
    assert "tiny.int8" in p.per_site["edge-a"]
