"""The TFLite writer's graph reading and quantization arithmetic, on hand-built ONNX graphs."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from mesh.errors import VariantBuildError
from variant_store.generate.ops import TFLITE_WRITER_OPS, has_conv, unsupported_nodes
from variant_store.generate.tflite_lower import (
    ConvLayer,
    DenseLayer,
    PoolLayer,
    ReshapeLayer,
    UnsupportedOp,
    act_qparams,
    extract_dense_chain,
    extract_layers,
    float_forward,
    padding_mode,
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
    np.testing.assert_allclose(float_forward(layers, x)[-1], want, rtol=1e-5, atol=1e-5)


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
    np.testing.assert_allclose(float_forward(layers, x)[-1], x @ w0 @ w1 + b1, rtol=1e-5, atol=1e-5)


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
    scale, zero = act_qparams(np.array([lo, lo + span], dtype=np.float64))
    assert scale > 0 and -128 <= zero <= 127
    # The range is widened to hold 0.0, which TFLite needs exactly representable (ReLU, padding).
    a = np.array([lo, lo + span, 0.0], dtype=np.float64)
    q = np.clip(np.round(a / scale) + zero, -128, 127)
    back = (q - zero) * scale
    assert np.all(np.abs(back - a) <= scale * 1.01 + 1e-9)


def _cnn(hw: tuple[int, int] = (8, 8), ch: int = 4, k: tuple[int, int] = (3, 3),
         strides: tuple[int, int] = (1, 1), pads: tuple[int, int, int, int] = (1, 1, 1, 1),
         pool: dict[str, Any] | None = None, extra: list[onnx.NodeProto] | None = None,
         conv_attrs: dict[str, Any] | None = None) -> onnx.ModelProto:
    """x (N, H*W) -> image -> Conv -> Relu [-> MaxPool] -> Flatten -> Gemm (3 outputs)."""
    h, w = hw
    oh = (h + pads[0] + pads[2] - k[0]) // strides[0] + 1
    ow = (w + pads[1] + pads[3] - k[1]) // strides[1] + 1
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["img"], name="to_img"),
        helper.make_node("Conv", ["img", "k", "kb"], ["c"], name="conv", kernel_shape=list(k),
                         strides=list(strides), pads=list(pads), **(conv_attrs or {})),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
    ]
    last = "r"
    if pool is not None:
        nodes.append(helper.make_node("MaxPool", ["r"], ["p"], name="pool", **pool))
        pk, ps, pp = pool["kernel_shape"], pool.get("strides", [1, 1]), pool.get("pads", [0, 0, 0, 0])
        oh = (oh + pp[0] + pp[2] - pk[0]) // ps[0] + 1
        ow = (ow + pp[1] + pp[3] - pk[1]) // ps[1] + 1
        last = "p"
    nodes += [*(extra or []),
              helper.make_node("Flatten", [last], ["f"], name="flat", axis=1),
              helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1)]
    inits = {"shape": np.array([-1, 1, h, w], np.int64), "k": _w(ch, 1, *k), "kb": _w(ch),
             "fw": _w(3, ch * oh * ow), "fb": _w(3)}
    return _graph(nodes, inits, n_in=h * w)


def _onnx_ref(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    from onnx.reference import ReferenceEvaluator

    outs: Any = ReferenceEvaluator(m).run(None, {"x": x})
    return np.asarray(outs[0])


def test_cnn_is_lowered_to_nhwc_layers_matching_the_onnx_reference() -> None:
    m = _cnn(pool={"kernel_shape": [2, 2], "strides": [2, 2]})
    assert has_conv(m) and unsupported_nodes(m, TFLITE_WRITER_OPS) == []
    _, _, layers = extract_layers(m)
    assert [type(lay) for lay in layers] == [ReshapeLayer, ConvLayer, PoolLayer, DenseLayer]
    reshape, conv, _, fc = layers
    assert isinstance(reshape, ReshapeLayer) and reshape.shape == (8, 8, 1)
    assert isinstance(conv, ConvLayer) and conv.relu and conv.weight.shape == (4, 3, 3, 1)  # OHWI
    k = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "k"))
    np.testing.assert_array_equal(conv.weight, k.transpose(0, 2, 3, 1))
    # The flatten is absorbed: the FC's columns are in NHWC order, so they differ from ONNX's.
    fw = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "fw"))
    assert isinstance(fc, DenseLayer) and not np.array_equal(fc.weight, fw)
    x = RNG.random((5, 64)).astype(np.float32)
    acts = float_forward(layers, x)
    assert [a.shape for a in acts] == [(5, 64), (5, 8, 8, 1), (5, 8, 8, 4), (5, 4, 4, 4), (5, 3)]
    np.testing.assert_allclose(acts[-1], _onnx_ref(m, x), rtol=1e-4, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(kh=st.integers(1, 3), kw=st.integers(1, 3), sh=st.integers(1, 2), sw=st.integers(1, 2),
       pads=st.tuples(*[st.integers(0, 2)] * 4), h=st.integers(4, 7), w=st.integers(4, 7))
def test_conv_float_forward_matches_onnx_for_any_stride_and_padding(
        kh: int, kw: int, sh: int, sw: int, pads: tuple[int, int, int, int], h: int, w: int) -> None:
    m = _cnn(hw=(h, w), ch=2, k=(kh, kw), strides=(sh, sw), pads=pads)
    _, _, layers = extract_layers(m)
    x = RNG.normal(size=(3, h * w)).astype(np.float32)
    np.testing.assert_allclose(float_forward(layers, x)[-1], _onnx_ref(m, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("hw", "k", "s", "pads", "want"), [
    ((8, 8), (3, 3), (1, 1), (1, 1, 1, 1), "SAME"),
    ((8, 8), (3, 3), (1, 1), (0, 0, 0, 0), "VALID"),
    ((7, 7), (2, 2), (2, 2), (0, 0, 1, 1), "SAME"),     # TFLite puts the odd pad after
    ((7, 7), (2, 2), (2, 2), (1, 1, 0, 0), None),       # ... ONNX may put it before
    ((8, 8), (3, 3), (1, 1), (2, 2, 2, 2), None),       # more than SAME: needs a PAD
    ((8, 6), (5, 3), (1, 1), (2, 1, 2, 1), "SAME"),
    ((8, 8), (2, 2), (2, 2), (0, 0, 0, 0), "VALID"),
])
def test_padding_mode_is_same_or_valid_only_where_exact(
        hw: tuple[int, int], k: tuple[int, int], s: tuple[int, int],
        pads: tuple[int, int, int, int], want: str | None) -> None:
    assert padding_mode(hw, k, s, pads) == want


@pytest.mark.parametrize(("kwargs", "node", "why"), [
    ({"conv_attrs": {"dilations": [2, 2]}}, "conv", "dilated"),
    ({"pool": {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}}, "pool", "ceil-mode"),
    ({"pool": {"kernel_shape": [3, 3], "pads": [2, 2, 2, 2]}}, "pool", "padding other than"),
    ({"extra": [helper.make_node("Relu", ["r"], ["r2"], name="relu_again")]}, "relu_again",
     "Relu not following"),
])
def test_conv_graphs_the_writer_cannot_lower_are_refused_naming_the_node(
        kwargs: dict[str, Any], node: str, why: str) -> None:
    m = _cnn(**kwargs)
    if node == "relu_again":  # re-wire the flatten onto the extra node's output
        m.graph.node[-2].input[0] = "r2"
    with pytest.raises(UnsupportedOp, match=why) as info:
        extract_layers(m)
    assert info.value.node == node


def test_multi_channel_image_reshape_is_refused_but_1x1_images_are_not() -> None:
    def graph(shape: list[int], ch_in: int) -> onnx.ModelProto:
        return _graph([
            helper.make_node("Reshape", ["x", "shape"], ["img"], name="to_img"),
            helper.make_node("Conv", ["img", "k"], ["c"], name="conv", kernel_shape=[1, 1]),
            helper.make_node("Flatten", ["c"], ["f"], name="flat"),
            helper.make_node("Gemm", ["f", "fw"], ["y"], name="fc", transB=1),
        ], {"shape": np.array(shape, np.int64), "k": _w(2, ch_in, 1, 1),
            "fw": _w(3, 2 * 6 // ch_in)})
    with pytest.raises(UnsupportedOp, match="multi-channel") as info:
        extract_layers(graph([-1, 3, 2, 1], 3))
    assert info.value.node == "to_img"
    # (N, 6, 1, 1) is the same bytes in NCHW and NHWC.
    m = graph([-1, 6, 1, 1], 6)
    _, _, layers = extract_layers(m)
    x = _w(4, 6)
    np.testing.assert_allclose(float_forward(layers, x)[-1], _onnx_ref(m, x), rtol=1e-4, atol=1e-4)


def test_unlowerable_conv_ops_and_dense_only_reads_name_the_node() -> None:
    m = _cnn()
    m.graph.node[1].op_type = "ConvTranspose"
    with pytest.raises(UnsupportedOp, match="unsupported op ConvTranspose at node 'conv'"):
        extract_layers(m)
    with pytest.raises(UnsupportedOp, match="non-dense layer") as info:
        extract_dense_chain(_cnn())
    assert info.value.node == "to_img"
