"""Issue 3, convolutions: full-integer INT8 TFLite variants of the committed digits CNNs, generated
by ``generate_variants``, run in the TFLite runtime, against their ONNX FP32 siblings on the
committed validation set (rows [:calib_count] calibrate, the rest evaluate)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mesh.errors import VariantBuildError
from variant_store.families.datasets import DIGITS_DIR, ValidationSet, load_validation_npz
from variant_store.generate import GeneratedVariant, generate_variants, tflite_lower
from variant_store.generate import tflite_writer as tw
from variant_store.runtimes import open_runtime

pytestmark = pytest.mark.integration

CNNS = ("cnn-small", "cnn-large")


@dataclass(frozen=True)
class Built:
    fp32: GeneratedVariant
    tflite: GeneratedVariant


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _logits(fmt: str, path: Path, x: np.ndarray) -> np.ndarray:
    rt = open_runtime(fmt, path)
    rt.load_sync()
    try:
        return np.asarray(rt.infer_sync({"x": x})["logits"])
    finally:
        rt.unload_sync()


def _ops_and_dtypes(path: Path) -> tuple[list[str], list[tuple[str, str, int, int]]]:
    """Builtin op names, and (name, dtype, number of scales, number of elements) of each tensor."""
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(path))
    interp.allocate_tensors()
    # ``_get_ops_details`` names the builtin of each node; no public API does.
    ops = [d["op_name"] for d in interp._get_ops_details()]
    tensors = [(d["name"], np.dtype(d["dtype"]).name, len(d["quantization_parameters"]["scales"]),
                int(np.prod(d["shape"]))) for d in interp.get_tensor_details()]
    return ops, tensors


@pytest.fixture(scope="module")
def val() -> ValidationSet:
    return load_validation_npz()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, val: ValidationSet) -> dict[str, Built]:
    out: dict[str, Built] = {}
    for name in CNNS:
        made, skipped = generate_variants(DIGITS_DIR / f"{name}.onnx", val.x[:val.calib_count],
                                          tmp_path_factory.mktemp(name), kinds=["onnx.fp32", "tflite.int8"])
        assert not skipped, skipped
        by_kind = {v.kind: v for v in made}
        out[name] = Built(by_kind["onnx.fp32"], by_kind["tflite.int8"])
    return out


@pytest.mark.parametrize("name", CNNS)
def test_cnn_tflite_int8_agrees_with_onnx_fp32_and_keeps_accuracy(
        name: str, built: dict[str, Built], val: ValidationSet) -> None:
    b = built[name]
    assert (b.tflite.format, b.tflite.precision, b.tflite.runtime) == ("tflite", "int8", "tflite")
    x, y = val.x[val.calib_count:], val.y[val.calib_count:]
    assert len(x) >= 500
    ref = _logits("onnx", b.fp32.path, x).argmax(1)
    got = _logits("tflite", b.tflite.path, x).argmax(1)
    agree = float(np.mean(ref == got))
    acc_fp32, acc_int8 = float(np.mean(ref == y)), float(np.mean(got == y))
    assert acc_fp32 > 0.95, acc_fp32  # a real trained CNN, so agreement is not trivially high
    assert agree >= 0.98, (name, agree)
    assert abs(acc_int8 - acc_fp32) <= 0.015, (name, acc_fp32, acc_int8)


@pytest.mark.parametrize("name", CNNS)
def test_cnn_tflite_is_full_integer_with_per_channel_convs(name: str, built: dict[str, Built]) -> None:
    b = built[name]
    ops, tensors = _ops_and_dtypes(b.tflite.path)
    assert {"RESHAPE", "CONV_2D", "MAX_POOL_2D", "FULLY_CONNECTED"} <= set(ops), ops
    assert all(dt in ("int8", "int32") for _, dt, _, _ in tensors), tensors
    weights = [(k, size) for n, dt, k, size in tensors if n.endswith(".weight")]
    assert weights and all(dt == "int8" for n, dt, _, _ in tensors if n.endswith(".weight"))
    assert all(k > 1 for k, _ in weights)  # one scale per output channel
    # Every float weight of the parent is there once, as one int8 byte.
    parent = onnx.load(str(b.fp32.path))
    float_weights = sum(int(np.prod(t.dims)) for t in parent.graph.initializer if len(t.dims) >= 2)
    assert sum(size for _, size in weights) == float_weights
    assert b.tflite.path.stat().st_size < b.fp32.path.stat().st_size


@pytest.mark.parametrize("name", CNNS)
def test_cnn_tflite_gives_the_same_answers_at_any_batch_size(
        name: str, built: dict[str, Built], val: ValidationSet) -> None:
    x = val.x[val.calib_count:val.calib_count + 33]
    whole = _logits("tflite", built[name].tflite.path, x)
    rt = open_runtime("tflite", built[name].tflite.path)
    rt.load_sync()
    try:
        parts = [rt.infer_sync({"x": x[i:j]})["logits"] for i, j in ((0, 1), (1, 8), (8, 33))]
    finally:
        rt.unload_sync()
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_cnn_regeneration_is_byte_identical(built: dict[str, Built], val: ValidationSet, tmp_path: Path) -> None:
    for name in CNNS:
        again, skipped = generate_variants(DIGITS_DIR / f"{name}.onnx", val.x[:val.calib_count],
                                           tmp_path / name, kinds=["tflite.int8"])
        assert not skipped and _sha(again[0].path) == _sha(built[name].tflite.path), name
    assert _sha(built["cnn-small"].tflite.path) != _sha(built["cnn-large"].tflite.path)


def _odd_cnn(path: Path, seed: int = 3) -> Path:
    """A conv whose ONNX pads are not SAME (so the writer inserts PAD), a stride-2 conv with
    SAME pads, and a max-pool, with random weights: exercises lowering paths the digits CNNs don't."""
    rng = np.random.default_rng(seed)
    inits = {
        "shape": np.array([-1, 1, 8, 8], np.int64),
        "k1": rng.normal(0, 0.4, (6, 1, 3, 3)), "b1": rng.normal(0, 0.1, 6),
        "k2": rng.normal(0, 0.2, (5, 6, 3, 3)), "b2": rng.normal(0, 0.1, 5),
        "fw": rng.normal(0, 0.2, (10, 5 * 3 * 3)), "fb": rng.normal(0, 0.1, 10),
    }
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["img"], name="to_img"),
        # 8x8 -> pads 2 all round -> 10x10: more than SAME, so PAD + VALID.
        helper.make_node("Conv", ["img", "k1", "b1"], ["c1"], name="conv_pad", kernel_shape=[3, 3],
                         pads=[2, 2, 2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        # 10x10, k3 s2, pads (0,0,1,1) = TFLite SAME -> 5x5.
        helper.make_node("Conv", ["r1", "k2", "b2"], ["c2"], name="conv_s2", kernel_shape=[3, 3],
                         strides=[2, 2], pads=[0, 0, 1, 1]),
        helper.make_node("MaxPool", ["c2"], ["p"], name="pool", kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),   # 5x5 -> 3x3, SAME
        helper.make_node("Flatten", ["p"], ["f"], name="flat", axis=1),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["logits"], name="fc", transB=1),
    ]
    g = helper.make_graph(nodes, "odd", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
                          [numpy_helper.from_array(v.astype(v.dtype if v.dtype == np.int64 else np.float32), k)
                           for k, v in inits.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())
    return path


def test_explicit_pad_stride_and_padded_pool_lower_correctly(tmp_path: Path, val: ValidationSet) -> None:
    parent = _odd_cnn(tmp_path / "odd.onnx")
    out = tw.write_tflite_int8(parent, val.x[:val.calib_count], tmp_path / "odd.tflite")
    ops, _ = _ops_and_dtypes(out)
    assert "PAD" in ops and ops.count("CONV_2D") == 2, ops
    x = val.x[val.calib_count:]
    ref = _logits("onnx", parent, x)
    got = _logits("tflite", out, x)
    # INT8 of random weights: close in value, not bit-equal; a layout or padding slip is far off.
    err = np.abs(got - ref).max() / (ref.max() - ref.min())
    assert err < 0.05, err
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.9


def test_a_misread_layout_is_caught_by_the_onnx_check(tmp_path: Path, val: ValidationSet,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Forget to reorder the flatten's NCHW columns: the float chain no longer matches ONNX Runtime.
    monkeypatch.setattr(tflite_lower, "_nchw_to_nhwc_columns", lambda w, *_: w)
    with pytest.raises(VariantBuildError, match="disagrees with ONNX Runtime"):
        tw.write_tflite_int8(DIGITS_DIR / "cnn-small.onnx", val.x[:64], tmp_path / "bad.tflite")
    assert not (tmp_path / "bad.tflite").exists()
