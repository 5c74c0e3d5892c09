"""Who may read which variant from the variant store (the rule; HTTPS in tests/integration/test_blob_server_tls.py)."""

from __future__ import annotations

import pytest

from mesh.pki.identity import Identity
from variant_store.access import blob_readable, may_read
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.unit

A, B = Identity("tenant", "a"), Identity("tenant", "b")
EDGE, SCHED, ADMIN = Identity("site", "edge-1"), Identity("scheduler", "s"), Identity("admin", "op")


def _meta(owner: str, digest: str, base: str | None = None) -> VariantMeta:
    return VariantMeta(task="t", family="f", variant_id=f"v-{digest[:3]}", format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest=digest, size_bytes=1, accuracy=0.5, owner=owner,
                       shared_base_digest=base)


def test_private_variants_are_read_by_their_tenant_serving_sites_and_admins() -> None:
    assert all(may_read(i, "public") for i in (A, B, EDGE, SCHED, ADMIN))
    assert may_read(A, "a") and not may_read(B, "a") and not may_read(SCHED, "a")
    assert may_read(EDGE, "a") and may_read(ADMIN, "a")
    assert not may_read(EDGE, "a", lambda site, tenant: tenant != "a")


def test_a_blob_follows_the_variants_that_name_it() -> None:
    metas = [_meta("a", "aaa", base="bbb"), _meta("public", "ccc", base="bbb"), _meta("b", "ddd")]
    assert blob_readable(A, "aaa", metas) and not blob_readable(B, "aaa", metas)
    assert blob_readable(B, "bbb", metas)  # a backbone shared with a public variant is public
    assert not blob_readable(A, "ddd", metas) and blob_readable(EDGE, "ddd", metas)
    assert not blob_readable(A, "eee", metas) and blob_readable(EDGE, "eee", metas)  # named by no variant
