"""The TFLite writer's graph reading and quantization arithmetic, on hand-built ONNX graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from mesh.errors import VariantBuildError
from variant_store.generate.ops import TFLITE_WRITER_OPS, has_conv, unsupported_nodes
from variant_store.generate.tflite_writer import (
    UnsupportedOp,
    _act_qparams,
    _float_chain,
    extract_dense_chain,
)

pytestmark = pytest.mark.unit

RNG = np.random.default_rng(7)


def _graph(nodes: list[onnx.NodeProto], inits: dict[str, np.ndarray], n_in: int = 6,
           n_out: int = 3) -> onnx.ModelProto:
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", n_out])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _w(*shape: int) -> np.ndarray:
    return RNG.normal(size=shape).astype(np.float32)


def test_gemm_relu_chain_is_read_with_fused_relu() -> None:
    w0, b0, w1, b1 = _w(4, 6), _w(4), _w(3, 4), _w(3)
    m = _graph([
        helper.make_node("Gemm", ["x", "w0", "b0"], ["h"], name="fc0", transB=1),
        helper.make_node("Relu", ["h"], ["r"], name="act0"),
        helper.make_node("Gemm", ["r", "w1", "b1"], ["y"], name="fc1", transB=1),
    ], {"w0": w0, "b0": b0, "w1": w1, "b1": b1})
    in_name, out_name, layers = extract_dense_chain(m)
    assert (in_name, out_name) == ("x", "y")
    assert [(lay.name, lay.relu) for lay in layers] == [("fc0", True), ("fc1", False)]
    x = _w(5, 6)
    want = np.maximum(x @ w0.T + b0, 0) @ w1.T + b1
    np.testing.assert_allclose(_float_chain(layers, x)[-1], want, rtol=1e-5, atol=1e-5)


def test_gemm_without_transb_and_matmul_add_are_transposed_to_out_in_layout() -> None:
    w0, w1, b1 = _w(6, 4), _w(4, 3), _w(3)   # (in, out) layouts
    m = _graph([
        helper.make_node("Gemm", ["x", "w0"], ["h"], name="fc0"),
        helper.make_node("Flatten", ["h"], ["f"], name="flat", axis=1),
        helper.make_node("MatMul", ["f", "w1"], ["mm"], name="mm1"),
        helper.make_node("Add", ["mm", "b1"], ["y"], name="add1"),
    ], {"w0": w0, "w1": w1, "b1": b1})
    _, _, layers = extract_dense_chain(m)
    assert [lay.weight.shape for lay in layers] == [(4, 6), (3, 4)]
    np.testing.assert_array_equal(layers[1].bias, b1)
    x = _w(2, 6)
    np.testing.assert_allclose(_float_chain(layers, x)[-1], x @ w0 @ w1 + b1, rtol=1e-5, atol=1e-5)


def test_conv_is_refused_naming_op_and_node() -> None:
    m = _graph([
        helper.make_node("Reshape", ["x", "shape"], ["img"], name="to_img"),
        helper.make_node("Conv", ["img", "k"], ["y"], name="conv_first", kernel_shape=[1, 1]),
    ], {"shape": np.array([-1, 6, 1, 1], np.int64), "k": _w(3, 6, 1, 1)})
    assert has_conv(m)
    assert unsupported_nodes(m, TFLITE_WRITER_OPS) == [("Conv", "conv_first")]
    with pytest.raises(UnsupportedOp) as info:
        extract_dense_chain(m)
    assert info.value.op == "Conv" and info.value.node == "conv_first"
    assert "unsupported op Conv at node 'conv_first'" in str(info.value)


def test_residual_add_is_refused() -> None:
    m = _graph([
        helper.make_node("Gemm", ["x", "w0", "b0"], ["h"], name="fc0", transB=1),
        helper.make_node("Add", ["h", "x"], ["y"], name="skip"),
    ], {"w0": _w(6, 6), "b0": _w(6)}, n_out=6)
    with pytest.raises(UnsupportedOp, match="skip"):
        extract_dense_chain(m)


def test_scaled_gemm_is_refused() -> None:
    m = _graph([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=1, alpha=0.5)],
               {"w": _w(3, 6), "b": _w(3)})
    with pytest.raises(VariantBuildError, match="fc"):
        extract_dense_chain(m)


@settings(max_examples=200, deadline=None)
@given(lo=st.floats(-50, 50), span=st.floats(1e-3, 100))
def test_activation_qparams_cover_range_and_zero(lo: float, span: float) -> None:
    scale, zero = _act_qparams(np.array([lo, lo + span], dtype=np.float64))
    assert scale > 0 and -128 <= zero <= 127
    # The range is widened to hold 0.0, which TFLite needs exactly representable (ReLU, padding).
    a = np.array([lo, lo + span, 0.0], dtype=np.float64)
    q = np.clip(np.round(a / scale) + zero, -128, 127)
    back = (q - zero) * scale
    assert np.all(np.abs(back - a) <= scale * 1.01 + 1e-9)
