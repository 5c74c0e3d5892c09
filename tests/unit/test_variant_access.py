"""Who may read which variant from the variant store (the rule; HTTPS in tests/integration/test_blob_server_tls.py)."""

from __future__ import annotations

import pytest

from mesh.pki.identity import Identity
from variant_store.access import blob_readable, may_read, site_tenants
from variant_store.catalog import RegisteredModel
from variant_store.meta import VariantMeta
from variant_store.placed import PlacedVariants, placed_pairs

pytestmark = pytest.mark.unit

A, B = Identity("tenant", "a"), Identity("tenant", "b")
EDGE, SCHED, ADMIN = Identity("site", "edge-1"), Identity("scheduler", "s"), Identity("admin", "op")
STORE, ETCD = Identity("store", "variant-store"), Identity("etcd", "etcd")


def _meta(owner: str, digest: str, base: str | None = None) -> VariantMeta:
    return VariantMeta(task="t", family="f", variant_id=f"v-{digest[:3]}", format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest=digest, size_bytes=1, accuracy=0.5, owner=owner,
                       shared_base_digest=base)


def _model(owner: str, parent: str, validation: str) -> RegisteredModel:
    return RegisteredModel(task="t", family=f"f-{owner}", parent_digest=parent, validation_digest=validation,
                           owner=owner)


def serves_a(site: str, tenant: str) -> bool:
    return tenant == "a"


def test_private_variants_are_read_by_their_tenant_the_sites_serving_it_and_operators() -> None:
    assert all(may_read(i, "public") for i in (A, B, EDGE, SCHED, ADMIN, STORE))
    assert may_read(A, "a") and not may_read(B, "a") and not may_read(SCHED, "a")
    assert may_read(ADMIN, "a") and may_read(STORE, "a")
    # a site reads a tenant's private variants only while it serves that tenant: by default it serves none
    assert not may_read(EDGE, "a")
    assert may_read(EDGE, "a", serves_a) and not may_read(EDGE, "b", serves_a)


def test_etcds_own_certificate_reads_nothing() -> None:
    assert not may_read(ETCD, "public") and not may_read(ETCD, "a", lambda s, t: True)
    assert not blob_readable(ETCD, "aaa", [_meta("public", "aaa")])


def test_a_blob_follows_the_variants_that_name_it() -> None:
    metas = [_meta("a", "aaa", base="bbb"), _meta("public", "ccc", base="bbb"), _meta("b", "ddd")]
    assert blob_readable(A, "aaa", metas) and not blob_readable(B, "aaa", metas)
    assert blob_readable(B, "bbb", metas)  # a backbone shared with a public variant is public
    assert not blob_readable(A, "ddd", metas) and not blob_readable(EDGE, "ddd", metas)
    assert blob_readable(EDGE, "ddd", metas, serves=lambda s, t: t == "b")
    # named by nothing: the operators' only
    assert not blob_readable(A, "eee", metas) and not blob_readable(EDGE, "eee", metas)
    assert not blob_readable(SCHED, "eee", metas)
    assert blob_readable(ADMIN, "eee", metas) and blob_readable(STORE, "eee", metas)


def test_validation_data_goes_to_its_owner_and_operators_only() -> None:
    """Labelled validation sets: the owning tenant (was refused), admins and stores; never a site (was: any) nor a
    scheduler (was: any non-tenant)."""
    models = [_model("a", "pa", "va"), _model("public", "pp", "vp")]
    readers = {who: blob_readable(who, "va", [], models, serves=lambda s, t: True)
               for who in (A, B, EDGE, SCHED, ADMIN, STORE)}
    assert readers == {A: True, B: False, EDGE: False, SCHED: False, ADMIN: True, STORE: True}
    # a public model's labels are no tenant's: operators only
    assert [w for w in (A, B, EDGE, SCHED, ADMIN, STORE) if blob_readable(w, "vp", [], models)] == [ADMIN, STORE]
    # the parent model follows its owner, as a variant does
    assert blob_readable(A, "pa", [], models) and not blob_readable(B, "pa", [], models)
    assert blob_readable(B, "pp", [], models)


def test_placement_names_the_tenants_a_site_serves() -> None:
    metas = [_meta("a", "aaa"), _meta("public", "ccc"), _meta("b", "ddd")]
    value = {"variants": [{"task": "t", "variant_id": "v-aaa"}, {"task": "t", "variant_id": "v-ccc"},
                          {"task": "x", "variant_id": "v-ddd"}, "junk", {"task": 1}]}
    pairs = placed_pairs(value)
    assert pairs == {("t", "v-aaa"), ("t", "v-ccc"), ("x", "v-ddd")}
    assert site_tenants(pairs, metas) == {"a"}  # v-ddd of task x is not b's variant of task t
    assert placed_pairs(None) == placed_pairs([1]) == placed_pairs({"variants": 3}) == frozenset()


def test_a_site_keeps_what_placement_moved_away_for_the_grace_only() -> None:
    now = [100.0]
    placed = PlacedVariants(store=None, grace_s=60.0, clock=lambda: now[0])  # type: ignore[arg-type]  # no etcd
    placed.record("edge-1", frozenset({("t", "v1"), ("t", "v2")}))
    now[0] = 110.0
    placed.record("edge-1", frozenset({("t", "v2")}))       # v1 moved away at 110
    assert placed._gone["edge-1"] == {("t", "v1"): 110.0}
    now[0] = 150.0
    placed.record("edge-1", frozenset({("t", "v1"), ("t", "v2")}))  # back again: no grace to track
    assert placed._gone["edge-1"] == {}
    placed.record("edge-1", frozenset())
    now[0] = 500.0
    placed.record("edge-1", frozenset())  # long gone: forgotten
    assert placed._gone["edge-1"] == {}
