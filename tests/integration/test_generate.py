"""Variant generation from a real trained MLP (and a conv graph for the op-set refusal)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TypeAlias

import numpy as np
import onnx
import pytest

from tests.helpers_models import conv_onnx, digits_split, trained_mlp_onnx
from variant_store.families.datasets import DIGITS_DIR, load_validation_npz
from variant_store.generate import ALL_KINDS, GeneratedVariant, SkippedVariant, generate_variants
from variant_store.hardware import tensorrt_available
from variant_store.runtimes import open_runtime

pytestmark = pytest.mark.integration

CPU_KINDS = ["onnx.fp32", "onnx.int8-dynamic", "onnx.int8-static", "onnx.fp16", "tflite.int8"]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _logits(v: GeneratedVariant, x: np.ndarray) -> np.ndarray:
    rt = open_runtime(v.format, v.path)
    rt.load_sync()
    try:
        assert rt.input_specs[0].dtype == "float32", v.kind  # same signature for every variant
        return rt.infer_sync({"x": x})["logits"]
    finally:
        rt.unload_sync()


Build: TypeAlias = tuple[Path, list[GeneratedVariant], list[SkippedVariant]]


@pytest.fixture(scope="module")
def mlp_build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    root = tmp_path_factory.mktemp("gen")
    parent = trained_mlp_onnx(root / "mlp.onnx")
    made, skipped = generate_variants(parent, digits_split().x_train[:512], root / "out")
    return parent, made, skipped


def test_every_cpu_kind_is_produced_and_runs_with_measured_accuracy(mlp_build: Build) -> None:
    parent, made, skipped = mlp_build
    by_kind = {v.kind: v for v in made}
    assert sorted(by_kind) == sorted(CPU_KINDS), skipped
    assert by_kind["onnx.fp32"].path.read_bytes() == parent.read_bytes()
    split = digits_split()
    acc = {k: float(np.mean(_logits(v, split.x_val).argmax(1) == split.y_val)) for k, v in by_kind.items()}
    assert acc["onnx.fp32"] > 0.93, acc
    for kind in ("onnx.int8-dynamic", "onnx.int8-static", "tflite.int8", "onnx.fp16"):
        assert abs(acc[kind] - acc["onnx.fp32"]) <= 0.02, (kind, acc)
    assert {v.precision for v in made} == {"fp32", "fp16", "int8"}
    assert by_kind["tflite.int8"].runtime == "tflite" and by_kind["onnx.fp16"].runtime == "onnxruntime"
    # Quantized variants really are smaller than the parent, not relabelled copies.
    assert by_kind["tflite.int8"].path.stat().st_size < parent.stat().st_size


def test_tflite_int8_agrees_with_onnx_fp32(mlp_build: Build) -> None:
    _, made, _ = mlp_build
    by_kind = {v.kind: v for v in made}
    x = digits_split().x_val
    ref = _logits(by_kind["onnx.fp32"], x).argmax(1)
    got = _logits(by_kind["tflite.int8"], x).argmax(1)
    assert np.mean(ref == got) >= 0.98


def test_tensorrt_skipped_with_reason_without_gpu(mlp_build: Build) -> None:
    _, _, skipped = mlp_build
    ok, why = tensorrt_available()
    if ok:
        pytest.skip("a TensorRT-capable GPU is present")
    assert [s.kind for s in skipped] == ["tensorrt.fp16"]
    assert skipped[0].reason == why and skipped[0].reason


def test_regeneration_is_byte_identical(mlp_build: Build, tmp_path: Path) -> None:
    parent, made, _ = mlp_build
    again, _ = generate_variants(parent, digits_split().x_train[:512], tmp_path / "again")
    first = {v.kind: _sha(v.path) for v in made}
    second = {v.kind: _sha(v.path) for v in again}
    assert first == second
    assert len(set(first.values())) == len(first)  # every variant is a distinct artefact


def test_conv_graph_builds_every_cpu_kind_including_tflite(tmp_path: Path) -> None:
    parent = conv_onnx(tmp_path / "conv.onnx")
    made, skipped = generate_variants(parent, digits_split().x_train[:128], tmp_path / "out",
                                      kinds=["onnx.fp32", "tflite.int8", "onnx.int8-static", "onnx.fp16"])
    assert skipped == []
    assert sorted(v.kind for v in made) == ["onnx.fp16", "onnx.fp32", "onnx.int8-static", "tflite.int8"]
    x = digits_split().x_val[:64]
    outs = {v.kind: _logits(v, x) for v in made}
    for kind, y in outs.items():
        assert y.shape == (64, 10) and np.all(np.isfinite(y)), kind


def test_an_op_the_tflite_writer_cannot_lower_skips_tflite_naming_it(tmp_path: Path) -> None:
    parent = conv_onnx(tmp_path / "conv.onnx")
    m = onnx.load(str(parent))
    next(n for n in m.graph.node if n.name == "pool1").op_type = "AveragePool"
    parent.write_bytes(m.SerializeToString())
    made, skipped = generate_variants(parent, digits_split().x_train[:128], tmp_path / "out",
                                      kinds=["onnx.fp32", "tflite.int8"])
    assert [s.kind for s in skipped] == ["tflite.int8"]
    assert "unsupported op AveragePool at node 'pool1'" in skipped[0].reason
    assert not (tmp_path / "out" / "conv.tflite.int8.tflite").exists()
    assert [v.kind for v in made] == ["onnx.fp32"]


def test_a_failing_generator_does_not_stop_the_others(tmp_path: Path) -> None:
    parent = trained_mlp_onnx(tmp_path / "mlp.onnx")
    # No calibration data: the static quantizer and the TFLite writer must fail, the rest succeed.
    made, skipped = generate_variants(parent, np.zeros((0, 64), np.float32), tmp_path / "out",
                                      kinds=["onnx.int8-static", "onnx.fp32", "tflite.int8", "bogus"])
    assert [v.kind for v in made] == ["onnx.fp32"]
    reasons = {s.kind: s.reason for s in skipped}
    assert set(reasons) == {"onnx.int8-static", "tflite.int8", "bogus"}
    assert "calibration" in reasons["onnx.int8-static"] and "calibration" in reasons["tflite.int8"]
    assert set(ALL_KINDS) >= {v.kind for v in made}


def test_tflite_is_skipped_with_the_reason_where_its_writer_is_absent(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A host without ai-edge-litert (a GPU image): TFLite variants are skipped with the reason, the others made."""
    import variant_store.generate as gen

    monkeypatch.setattr(gen, "tflite_writer_available", lambda: False)
    x = load_validation_npz().x_calib
    made, skipped = gen.generate_variants(DIGITS_DIR / "mlp-tiny.onnx", x, tmp_path, kinds=["onnx.fp32", "tflite.int8"])
    assert [m.kind for m in made] == ["onnx.fp32"]
    assert [(s.kind, "ai-edge-litert" in s.reason) for s in skipped] == [("tflite.int8", True)]
    assert not list(tmp_path.glob("*.tflite"))
