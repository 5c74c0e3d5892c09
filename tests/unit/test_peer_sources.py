"""Which peers an agent asks for a blob (edge_agent.blobs.peer_sources): live sites holding a public variant built
on it, nearest first; never a peer for a tenant's private blob (that comes from the variant store only)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from edge_agent.blobs import peer_sources, public_blob
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.unit

PUB, PRIV = "a" * 64, "b" * 64


def _meta(vid: str, digest: str, owner: str = "public") -> VariantMeta:
    return VariantMeta(task="t", family="f", variant_id=vid, format="onnx", precision="fp32", runtime="onnxruntime",
                       blob_digest=digest, size_bytes=1000, accuracy=0.9, owner=owner)


METAS = {m.variant_id: m for m in (_meta("pub", PUB), _meta("priv", PRIV, owner="acme"))}
LIVE = {"near": SimpleNamespace(loaded={"pub": 1, "priv": 1}), "far": SimpleNamespace(loaded={"pub": 1}),
        "here": SimpleNamespace(loaded={"pub": 1, "priv": 1})}


def _sources(digest: str) -> list[str]:
    return [s.site for s in peer_sources(digest, "here", LIVE, {"near": 1.0, "far": 9.0}.__getitem__,
                                         METAS.get, lambda site: f"https://{site}")]


def test_a_public_blob_comes_from_the_nearest_holder_first() -> None:
    assert _sources(PUB) == ["near", "far"]


def test_no_peer_is_asked_for_a_private_blob() -> None:
    assert _sources(PRIV) == []


def test_only_a_blob_a_public_variant_names_is_shared() -> None:
    shared_base = _meta("head", "c" * 64, owner="acme")
    shared_base.shared_base_digest = PUB
    assert public_blob(PUB, METAS.values()) and not public_blob(PRIV, METAS.values())
    assert not public_blob("c" * 64, [shared_base]) and not public_blob("d" * 64, METAS.values())
