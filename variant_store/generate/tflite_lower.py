"""Lower an ONNX MLP or small CNN into a layer chain for the INT8 ``.tflite`` writer, and run it in float.

What it lowers is a sequential chain:

* dense layers (``Gemm``, or ``MatMul`` + constant ``Add``) -> ``FULLY_CONNECTED``;
* ``Conv`` (group 1, no dilation, bias optional) -> ``CONV_2D`` with SAME / VALID padding where
  that is exactly ONNX's explicit ``pads``, otherwise an int8 ``PAD`` in front of a VALID conv;
* ``MaxPool`` (no ceil mode, pads exactly SAME or none) -> ``MAX_POOL_2D``;
* ``Relu`` fused into the dense or conv layer before it;
* ``Reshape`` of the (N, F) input to (N, C, H, W) -> ``RESHAPE`` to NHWC, which is the same
  memory order only when C == 1 or H * W == 1 (anything else is refused);
* ``Flatten`` (or a 2-D ``Reshape``) of a 4-D tensor, absorbed by the next dense layer: ONNX
  flattens NCHW, TFLite holds NHWC, so that layer's weight columns are permuted at conversion
  time instead of paying for a ``TRANSPOSE`` per query.

Anything else is refused up front with ``UnsupportedOp`` naming the op and the node.

The float chain (numpy, NHWC, the lowered weights) gives the calibration ranges; see
:mod:`variant_store.generate.tflite_writer` for how the pieces are put together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import onnx
from numpy.lib.stride_tricks import sliding_window_view
from onnx import helper, numpy_helper

from mesh.errors import VariantBuildError
from variant_store.generate.ops import TFLITE_WRITER_OPS, first_unsupported

__all__ = [
    "ConvLayer",
    "DenseLayer",
    "Layer",
    "PoolLayer",
    "ReshapeLayer",
    "UnsupportedOp",
    "act_qparams",
    "extract_dense_chain",
    "extract_layers",
    "float_forward",
    "padding_mode",
]

Pads: TypeAlias = tuple[int, int, int, int]   # top, left, bottom, right


class UnsupportedOp(VariantBuildError):
    """The graph has an op (or an op use) the TFLite writer does not lower."""

    def __init__(self, op: str, node: str, why: str = "unsupported op") -> None:
        super().__init__(f"TFLite writer: {why} {op} at node '{node}'", op=op, node=node)
        self.op, self.node = op, node


@dataclass
class DenseLayer:
    weight: np.ndarray   # (out, in) float32, TFLite's FULLY_CONNECTED layout (NHWC column order)
    bias: np.ndarray     # (out,) float32
    relu: bool
    name: str


@dataclass
class ConvLayer:
    weight: np.ndarray   # (out, kh, kw, in) float32: TFLite's OHWI
    bias: np.ndarray     # (out,) float32
    strides: tuple[int, int]
    pads: Pads
    relu: bool
    name: str


@dataclass
class PoolLayer:
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: Pads
    name: str


@dataclass
class ReshapeLayer:
    shape: tuple[int, ...]   # per-sample NHWC shape after the reshape
    name: str


Layer: TypeAlias = DenseLayer | ConvLayer | PoolLayer | ReshapeLayer


def _ints(v: Any, n: int, default: int) -> tuple[int, ...]:
    return tuple(int(i) for i in v) if v is not None else (default,) * n


def _input_features(model: onnx.ModelProto, name: str) -> int | None:
    inp = next(i for i in model.graph.input if i.name == name)
    dims = inp.type.tensor_type.shape.dim
    return int(dims[-1].dim_value) if len(dims) == 2 and dims[-1].dim_value > 0 else None


def extract_layers(model: onnx.ModelProto) -> tuple[str, str, list[Layer]]:
    """(input name, output name, layers) of a sequential graph; raises ``UnsupportedOp`` otherwise."""
    bad = first_unsupported(model, TFLITE_WRITER_OPS)
    if bad is not None:
        raise UnsupportedOp(*bad)
    g = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    inputs = [i for i in g.input if i.name not in consts]
    if len(inputs) != 1 or len(g.output) != 1:
        raise VariantBuildError("TFLite writer: needs exactly one graph input and one output")
    current = inputs[0].name
    feats = _input_features(model, current)
    shape: tuple[int, ...] | None = (feats,) if feats else None   # per-sample, NHWC when 3-D
    nchw_flat: tuple[int, int, int] | None = None   # (H, W, C) of a flatten the next FC must undo
    layers: list[Layer] = []
    pending_matmul: DenseLayer | None = None
    for node in g.node:
        op, name = node.op_type, node.name or node.output[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if op == "Constant":
            consts[node.output[0]] = numpy_helper.to_array(attrs["value"])
            continue
        act = [i for i in node.input if i and i not in consts]
        if len(act) != 1 or act[0] != current or len([o for o in node.output if o]) != 1:
            raise UnsupportedOp(op, name, "non-sequential use of")
        if nchw_flat is not None and op not in ("Gemm", "MatMul", "Identity", "Relu"):
            raise UnsupportedOp(op, name, "a 4-D flatten must feed a dense layer, not")
        if op == "Identity":
            pass
        elif op in ("Flatten", "Reshape"):
            target = consts.get(node.input[1]) if op == "Reshape" else None
            if op == "Flatten" and attrs.get("axis", 1) != 1:
                raise UnsupportedOp(op, name, "axis != 1")
            if op == "Reshape" and (target is None or len(target) not in (2, 4)):
                raise UnsupportedOp(op, name, "non-constant or not 2-D/4-D")
            if target is not None and len(target) == 4:
                shape = _image_reshape(target, shape, op, name)
                layers.append(ReshapeLayer(shape, name))
            elif shape is not None and len(shape) == 3:
                nchw_flat = (shape[0], shape[1], shape[2])
                shape = (int(np.prod(shape)),)
            # else: 2-D -> 2-D glue is a no-op.
        elif op in ("Gemm", "MatMul"):
            layer = _dense(op, name, node, attrs, consts)
            if nchw_flat is not None:
                layer.weight = _nchw_to_nhwc_columns(layer.weight, nchw_flat, op, name)
                nchw_flat = None
            if op == "MatMul":
                pending_matmul = layer
            layers.append(layer)
            shape = (layer.weight.shape[0],)
        elif op == "Add":
            if pending_matmul is None or layers[-1] is not pending_matmul:
                raise UnsupportedOp(op, name, "Add not following a MatMul:")
            bias_name = next(i for i in node.input if i in consts)
            pending_matmul.bias = consts[bias_name].astype(np.float32).reshape(-1)
            pending_matmul = None
        elif op == "Relu":
            last = layers[-1] if layers else None
            if not isinstance(last, DenseLayer | ConvLayer) or last.relu:
                raise UnsupportedOp(op, name, "Relu not following a dense or conv layer:")
            last.relu = True
        elif op in ("Conv", "MaxPool"):
            if shape is None or len(shape) != 3:
                raise UnsupportedOp(op, name, "non-image input to")
            conv = _conv(name, node, attrs, consts, shape[2]) if op == "Conv" else _pool(name, attrs)
            if isinstance(conv, PoolLayer) and padding_mode(shape[:2], conv.kernel, conv.strides,
                                                            conv.pads) is None:
                # ONNX pads a max-pool with -inf; TFLite's SAME does too, an int8 PAD cannot.
                raise UnsupportedOp(op, name, "padding other than SAME/VALID in")
            layers.append(conv)
            shape = _spatial_out(shape, conv)
        current = node.output[0]
    if g.output[0].name != current or not layers:
        raise VariantBuildError("TFLite writer: the graph output is not the end of the chain")
    if nchw_flat is not None or isinstance(layers[-1], ReshapeLayer) or len(shape or ()) != 1:
        raise VariantBuildError("TFLite writer: the graph must end in a dense layer's (N, F) output")
    return inputs[0].name, g.output[0].name, layers


def extract_dense_chain(model: onnx.ModelProto) -> tuple[str, str, list[DenseLayer]]:
    """Like ``extract_layers`` for graphs that must be dense-only (an MLP)."""
    in_name, out_name, layers = extract_layers(model)
    dense = [lay for lay in layers if isinstance(lay, DenseLayer)]
    if len(dense) != len(layers):
        first = next(lay for lay in layers if not isinstance(lay, DenseLayer))
        raise UnsupportedOp(type(first).__name__, first.name, "non-dense layer")
    return in_name, out_name, dense


def _image_reshape(target: np.ndarray, shape: tuple[int, ...] | None, op: str,
                   name: str) -> tuple[int, int, int]:
    if shape is None or len(shape) != 1 or int(target[0]) not in (-1, 0):
        raise UnsupportedOp(op, name, "4-D reshape of a non-(N, F) tensor or with a fixed batch in")
    chw = [int(d) for d in target[1:]]
    if 0 in chw or chw.count(-1) > 1:
        raise UnsupportedOp(op, name, "copy-dim or ambiguous shape in")
    if -1 in chw:
        known = int(np.prod([d for d in chw if d != -1]))
        chw[chw.index(-1)] = shape[0] // known if known and shape[0] % known == 0 else -1
    c, h, w = chw
    if min(c, h, w) < 1 or c * h * w != shape[0]:
        raise UnsupportedOp(op, name, f"shape {tuple(int(d) for d in target)} does not fit in")
    if c != 1 and h * w != 1:
        # NCHW and NHWC share a memory order only then; otherwise a TRANSPOSE would be needed.
        raise UnsupportedOp(op, name, "multi-channel image reshape")
    return h, w, c


def _dense(op: str, name: str, node: onnx.NodeProto, attrs: dict[str, Any],
           consts: dict[str, np.ndarray]) -> DenseLayer:
    if node.input[1] not in consts:
        raise UnsupportedOp(op, name, "non-constant weight in")
    w = consts[node.input[1]].astype(np.float32)
    if op == "MatMul":
        return DenseLayer(np.ascontiguousarray(w.T), np.zeros(w.shape[1], np.float32), False, name)
    if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
        raise UnsupportedOp(op, name, "scaled or transposed-A")
    w = w if attrs.get("transB", 0) else w.T
    b = (consts[node.input[2]].astype(np.float32) if len(node.input) > 2 and node.input[2]
         else np.zeros(w.shape[0], np.float32))
    return DenseLayer(np.ascontiguousarray(w), b.reshape(-1), False, name)


def _nchw_to_nhwc_columns(w: np.ndarray, hwc: tuple[int, int, int], op: str, name: str) -> np.ndarray:
    h, wd, c = hwc
    if w.shape[1] != h * wd * c:
        raise UnsupportedOp(op, name, "weight width does not match the flattened image in")
    return np.ascontiguousarray(w.reshape(-1, c, h, wd).transpose(0, 2, 3, 1).reshape(w.shape[0], -1))


def _conv(name: str, node: onnx.NodeProto, attrs: dict[str, Any], consts: dict[str, np.ndarray],
          in_ch: int) -> ConvLayer:
    if node.input[1] not in consts or (len(node.input) > 2 and node.input[2] and node.input[2] not in consts):
        raise UnsupportedOp("Conv", name, "non-constant weight or bias in")
    w = consts[node.input[1]].astype(np.float32)
    if w.ndim != 4 or attrs.get("group", 1) != 1 or w.shape[1] != in_ch:
        raise UnsupportedOp("Conv", name, "grouped, non-2-D or channel-mismatched")
    if any(d != 1 for d in _ints(attrs.get("dilations"), 2, 1)):
        raise UnsupportedOp("Conv", name, "dilated")
    b = (consts[node.input[2]].astype(np.float32).reshape(-1) if len(node.input) > 2 and node.input[2]
         else np.zeros(w.shape[0], np.float32))
    sh, sw = _ints(attrs.get("strides"), 2, 1)
    return ConvLayer(np.ascontiguousarray(w.transpose(0, 2, 3, 1)), b, (sh, sw),
                     _onnx_pads("Conv", name, attrs), False, name)


def _pool(name: str, attrs: dict[str, Any]) -> PoolLayer:
    if attrs.get("ceil_mode", 0) or attrs.get("storage_order", 0):
        raise UnsupportedOp("MaxPool", name, "ceil-mode or column-major")
    if any(d != 1 for d in _ints(attrs.get("dilations"), 2, 1)):
        raise UnsupportedOp("MaxPool", name, "dilated")
    kh, kw = _ints(attrs["kernel_shape"], 2, 1)
    sh, sw = _ints(attrs.get("strides"), 2, 1)
    return PoolLayer((kh, kw), (sh, sw), _onnx_pads("MaxPool", name, attrs), name)


def _onnx_pads(op: str, name: str, attrs: dict[str, Any]) -> Pads:
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else str(auto)
    if auto not in ("NOTSET", "VALID"):
        raise UnsupportedOp(op, name, f"auto_pad={auto} in")
    t, left, b, r = _ints(attrs.get("pads") if auto == "NOTSET" else None, 4, 0)
    return t, left, b, r


def _spatial_out(shape: tuple[int, ...], layer: ConvLayer | PoolLayer) -> tuple[int, int, int]:
    h, w, c = shape
    kh, kw = layer.weight.shape[1:3] if isinstance(layer, ConvLayer) else layer.kernel
    t, left, b, r = layer.pads
    oh = (h + t + b - kh) // layer.strides[0] + 1
    ow = (w + left + r - kw) // layer.strides[1] + 1
    if oh < 1 or ow < 1:
        raise UnsupportedOp(type(layer).__name__, layer.name, "empty output of")
    return oh, ow, (layer.weight.shape[0] if isinstance(layer, ConvLayer) else c)


def padding_mode(hw: tuple[int, int], kernel: tuple[int, int], strides: tuple[int, int],
                 pads: Pads) -> str | None:
    """``"VALID"`` / ``"SAME"`` when TFLite's padding equals ONNX's explicit ``pads``, else None."""
    if not any(pads):
        return "VALID"
    same: list[int] = []
    for n, k, s in zip(hw, kernel, strides, strict=True):
        total = max((-(-n // s) - 1) * s + k - n, 0)
        same += [total // 2, total - total // 2]
    return "SAME" if (same[0], same[2], same[1], same[3]) == pads else None


def float_forward(layers: Sequence[Layer], x: np.ndarray) -> list[np.ndarray]:
    """Every layer's float output (NHWC for images), starting with the input itself."""
    acts = [x.astype(np.float32)]
    for layer in layers:
        a = acts[-1]
        if isinstance(layer, ReshapeLayer):
            acts.append(a.reshape(len(a), *layer.shape))
            continue
        if isinstance(layer, PoolLayer):
            acts.append(_windows(a, layer.kernel, layer.strides, layer.pads, -np.inf).max(axis=(4, 5)))
            continue
        if isinstance(layer, DenseLayer):
            z = a.reshape(len(a), -1) @ layer.weight.T + layer.bias
        else:
            win = _windows(a, layer.weight.shape[1:3], layer.strides, layer.pads, 0.0)
            z = np.tensordot(win, layer.weight, axes=([3, 4, 5], [3, 1, 2])) + layer.bias
        acts.append(np.maximum(z, 0) if layer.relu else z)
    return acts


def _windows(a: np.ndarray, kernel: tuple[int, ...], strides: tuple[int, int], pads: Pads,
             fill: float) -> np.ndarray:
    """(N, OH, OW, C, kh, kw) view of ``a`` (N, H, W, C) under ONNX's explicit padding."""
    t, left, b, r = pads
    ap = np.pad(a, ((0, 0), (t, b), (left, r), (0, 0)), constant_values=fill) if any(pads) else a
    win = sliding_window_view(ap, tuple(kernel), axis=(1, 2))
    return win[:, ::strides[0], ::strides[1]]


def act_qparams(a: np.ndarray) -> tuple[float, int]:
    lo, hi = min(float(a.min()), 0.0), max(float(a.max()), 0.0)
    scale = (hi - lo) / 255.0 if hi > lo else 1.0
    zero = int(np.clip(round(-128 - lo / scale), -128, 127))
    return scale, zero
