"""Issue 3's Done-when on the committed digits family, on a real etcd and real runtimes:
at least 8 variants across ONNX FP32, ONNX INT8 and TFLite INT8, each with measured accuracy and a
profile for this machine's hardware class; TFLite INT8 of an MLP agrees with its ONNX sibling on
>= 98 % of the validation set; a rebuild gives the same digests and accuracy within 0.5 points."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mesh.etcd.store import Store
from variant_store.blobs import BlobStore
from variant_store.build import ensure_digits_family
from variant_store.catalog import Catalog
from variant_store.families.datasets import load_validation_npz
from variant_store.hardware import local_hardware_class
from variant_store.runtimes import open_runtime

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TASK = "digit-classification"


async def _build(store: Store, blobs: BlobStore, force: bool) -> dict[str, tuple[str, float]]:
    catalog = Catalog(store)
    await ensure_digits_family(catalog, blobs, repeats=3, force=force, progress=False)
    return {v.variant_id: (v.blob_digest, v.accuracy) for v in await catalog.list_variants(TASK)}


async def test_digits_family_variants_and_rebuild(store: Store, tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    first = await _build(store, blobs, force=False)
    metas = await Catalog(store).list_variants(TASK)
    public = [m for m in metas if m.owner == "public"]
    kinds = {(m.format, m.precision) for m in public}
    assert len(public) >= 8
    assert {("onnx", "fp32"), ("onnx", "int8"), ("tflite", "int8")} <= kinds
    hw = local_hardware_class()
    for m in public:
        assert 0.9 < m.accuracy <= 1.0, m.variant_id
        prof = m.profiles[hw]
        assert prof.latency[1].p50_ms > 0 and prof.load_ms > 0, m.variant_id
        assert blobs.has(m.blob_digest)

    # TFLite INT8 vs its ONNX FP32 sibling, argmax agreement on the whole validation set
    val = load_validation_npz()
    by_id = {m.variant_id: m for m in metas}
    for fam in ("mlp-tiny", "mlp-wide"):
        preds = []
        for vid in (f"{fam}.onnx.fp32", f"{fam}.tflite.int8"):
            m = by_id[vid]
            rt = open_runtime(m.format, blobs.path(m.blob_digest))
            await rt.load()
            try:
                preds.append(np.argmax(rt.infer_sync({"x": val.x})["logits"], axis=1))
            finally:
                await rt.unload()
        assert float(np.mean(preds[0] == preds[1])) >= 0.98, fam

    second = await _build(store, blobs, force=True)
    assert set(second) == set(first)
    for vid, (digest, acc) in first.items():
        assert second[vid][0] == digest, f"{vid}: digest changed on rebuild"
        assert abs(second[vid][1] - acc) <= 0.005, vid
