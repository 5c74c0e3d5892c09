"""The text family's two-stage pipeline (issue 33, item 2; ``variant_store.text_pipeline``), built with real etcd
and real ONNX Runtime: ``text-group`` picks the group, a per-group head on the same embedding the section. Its 4
heads are catalogued as tasks of their own, the Switch is registered with its end-to-end accuracy measured on the
held-out rows, compared here with the flat 10-way topic head on the same encoder."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mesh.etcd.store import Store
from variant_store.blobs import BlobStore
from variant_store.build_text import ensure_text_family
from variant_store.catalog import Catalog
from variant_store.families.text_corpus import GROUPS
from variant_store.pipeline_catalog import get_pipeline
from variant_store.text_pipeline import PIPELINE_TASK, group_task

pytestmark = pytest.mark.integration


async def test_text_pipeline_registered_and_measured(store: Store, tmp_path: Path) -> None:
    catalog, blobs = Catalog(store), BlobStore(tmp_path / "blobs")
    t0 = time.monotonic()
    await ensure_text_family(catalog, blobs, backbones=["minilm-l6-int8"], repeats=2, progress=False)
    took = time.monotonic() - t0
    meta = await get_pipeline(store, PIPELINE_TASK)
    assert meta.kind == "switch" and meta.owner == "globex" and meta.stages[0].task == "text-group"
    assert meta.table == tuple((i, group_task(g)) for i, g in enumerate(GROUPS))
    assert [(i.name, i.dtype) for i in meta.signature.inputs] == [("text", "object")]
    assert [(o.name, o.shape) for o in meta.signature.outputs] == [("logits", (-1, 10))]
    for g in GROUPS:
        (v,) = await catalog.list_variants(group_task(g))
        assert v.owner == "globex" and v.family == f"section-{g}-minilm-l6-int8"
        assert meta.floor(group_task(g)) == v.accuracy
    flat = next(v for v in await catalog.list_variants("text-topic") if v.family == "topic-minilm-l6-int8")
    assert meta.accuracy is not None and meta.heldout_rows > 300
    print(f"\n{PIPELINE_TASK}: held-out {meta.accuracy:.4f} on {meta.heldout_rows} rows; flat topic head "
          f"{flat.accuracy:.4f}; family + pipeline built in {took:.1f} s")
    # the hierarchy is no worse than the flat head by more than 3 standard errors (~2 points each here)
    se = (flat.accuracy * (1.0 - flat.accuracy) / meta.heldout_rows) ** 0.5
    assert meta.accuracy >= flat.accuracy - 3.0 * se
    # built again: left alone (its entry and heads are there)
    before = (await store.get(f"pipelines/{PIPELINE_TASK}"))
    await ensure_text_family(catalog, blobs, backbones=["minilm-l6-int8"], repeats=2, progress=False)
    after = await store.get(f"pipelines/{PIPELINE_TASK}")
    assert before is not None and after is not None and before.mod_revision == after.mod_revision
