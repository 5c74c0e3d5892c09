"""The committed digits models: intact, loadable in ONNX Runtime, and as accurate as the manifest says."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from variant_store.families.datasets import (
    DIGITS_DIR,
    ValidationSet,
    load_digits_manifest,
    load_validation_npz,
)

pytestmark = pytest.mark.integration

# Bands are wide enough for a retrain with another seed, narrow enough to catch a broken model.
BANDS = {
    "mlp-tiny": (0.94, 0.985),
    "mlp-wide": (0.955, 0.995),
    "cnn-small": (0.96, 0.995),
    "cnn-large": (0.975, 1.0),
    "head-digits": (0.955, 1.0),
    "head-parity": (0.965, 1.0),
}
CLASSIFIERS = ("mlp-tiny", "mlp-wide", "cnn-small", "cnn-large")
TOTAL_BYTES_LIMIT = 5 * 2**20


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return load_digits_manifest()


@pytest.fixture(scope="module")
def val() -> ValidationSet:
    return load_validation_npz()


def _by_family(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["family"]: m for m in manifest["models"]}


def _session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    sess = _session(path)
    return np.asarray(sess.run(None, {sess.get_inputs()[0].name: x})[0])


def _acc(logits: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(logits, axis=1) == y))


def test_manifest_lists_every_family_and_role(manifest: dict[str, Any]) -> None:
    fams = _by_family(manifest)
    assert set(CLASSIFIERS) | {"backbone", "head-digits", "head-parity"} <= set(fams)
    assert {fams[f]["role"] for f in CLASSIFIERS} == {"model"}
    assert fams["backbone"]["role"] == "backbone"
    assert fams["head-digits"]["owner"] == "acme"
    assert fams["head-parity"]["owner"] == "globex"
    assert fams["head-digits"]["task"] == "digit-classification"
    assert fams["head-parity"]["task"] == "digit-parity"
    for head in ("head-digits", "head-parity"):
        assert fams[head]["role"] == "head" and fams[head]["backbone"] == "backbone.onnx"
        assert fams[head]["backbone_sha256"] == fams["backbone"]["sha256"]


def test_files_match_manifest_digests(manifest: dict[str, Any]) -> None:
    total = 0
    for m in manifest["models"]:
        data = (DIGITS_DIR / m["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == m["sha256"], m["file"]
        assert len(data) == m["size_bytes"]
        total += len(data)
    assert total < TOTAL_BYTES_LIMIT
    npz = (DIGITS_DIR / manifest["dataset"]["file"]).read_bytes()
    assert hashlib.sha256(npz).hexdigest() == manifest["dataset"]["sha256"]


@pytest.mark.parametrize("family", CLASSIFIERS)
def test_classifier_signature_and_accuracy(family: str, manifest: dict[str, Any], val: ValidationSet) -> None:
    entry = _by_family(manifest)[family]
    path = DIGITS_DIR / entry["file"]
    onnx.checker.check_model(str(path))
    sess = _session(path)
    (inp,), (out,) = sess.get_inputs(), sess.get_outputs()
    assert (inp.name, inp.type, inp.shape[1]) == ("x", "tensor(float)", 64)
    assert out.name == "logits" and out.shape[1] == 10
    logits = np.asarray(sess.run(None, {"x": val.x_holdout})[0])
    assert logits.shape == (len(val.y_holdout), 10) and logits.dtype == np.float32
    acc = _acc(logits, val.y_holdout)
    assert abs(acc - entry["accuracy"]) <= 0.005
    lo, hi = BANDS[family]
    assert lo <= acc <= hi
    # A single row must give the same answer as that row inside a batch (dynamic batch axis works).
    one = np.asarray(sess.run(None, {"x": val.x_holdout[:1]})[0])
    np.testing.assert_allclose(one[0], logits[0], rtol=1e-4, atol=1e-5)


def test_capacity_ordering(manifest: dict[str, Any], val: ValidationSet) -> None:
    fams = _by_family(manifest)
    tiny = _acc(_run(DIGITS_DIR / fams["mlp-tiny"]["file"], val.x_holdout), val.y_holdout)
    large = _acc(_run(DIGITS_DIR / fams["cnn-large"]["file"], val.x_holdout), val.y_holdout)
    assert large - tiny >= 0.01, f"cnn-large {large:.4f} should clearly beat mlp-tiny {tiny:.4f}"
    assert fams["cnn-large"]["params"] > 10 * fams["mlp-tiny"]["params"]


def test_graphs_use_simple_ops(manifest: dict[str, Any]) -> None:
    # Other converters (TFLite writer, quantizers) rely on this small op set.
    allowed = {"Gemm", "MatMul", "Add", "Relu", "Conv", "MaxPool", "Flatten", "Reshape", "Constant"}
    for m in manifest["models"]:
        ops = {n.op_type for n in onnx.load(str(DIGITS_DIR / m["file"])).graph.node}
        assert ops <= allowed, (m["file"], ops - allowed)
        assert "BatchNormalization" not in ops and "Dropout" not in ops


def test_backbone_plus_heads_reproduce_head_accuracy(manifest: dict[str, Any], val: ValidationSet) -> None:
    fams = _by_family(manifest)
    feats = _run(DIGITS_DIR / fams["backbone"]["file"], val.x_holdout)
    assert feats.shape == (len(val.y_holdout), fams["head-digits"]["inputs"][0]["shape"][1])
    for head, labels, ncls in (("head-digits", val.y_holdout, 10), ("head-parity", val.y_holdout % 2, 2)):
        logits = _run(DIGITS_DIR / fams[head]["file"], feats)
        assert logits.shape == (len(labels), ncls)
        acc = _acc(logits, labels)
        assert abs(acc - fams[head]["accuracy"]) <= 0.005, head
        lo, hi = BANDS[head]
        assert lo <= acc <= hi, head
    # The parity head must read the digit features, not guess: chance would be ~50 %.
    shuffled = _run(DIGITS_DIR / fams["head-parity"]["file"], feats[::-1].copy())
    assert _acc(shuffled, val.y_holdout % 2) < 0.75
