"""A full-integer INT8 ``.tflite`` written from an ONNX MLP, without TensorFlow.

The model is built with the flatbuffer object API that ships inside the installed
``ai_edge_litert`` (``schema_py_generated``). What it lowers: a chain of dense layers (``Gemm``,
or ``MatMul`` + constant ``Add``) with ``Relu`` fused into the layer before it, and shape no-ops
(``Flatten`` / ``Reshape`` / ``Identity`` that keep the tensor 2-D). Anything else is refused up
front with ``UnsupportedOp`` naming the op and the node.

Quantization follows TFLite's integer spec: activations asymmetric int8 per tensor, ranges from
running the float chain over the calibration inputs; weights symmetric int8 per output channel
(``quantized_dimension`` 0) or per tensor; bias int32 with scale = input scale x weight scale.
Input and output tensors are int8; ``TFLiteRuntime`` quantizes / dequantizes at the boundary.
The float chain is checked against ONNX Runtime on the calibration inputs before anything is
written, so a graph this writer misreads is an error, not a silently wrong variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mesh.errors import VariantBuildError
from variant_store.generate.ops import TFLITE_WRITER_OPS, first_unsupported

__all__ = ["DenseLayer", "UnsupportedOp", "extract_dense_chain", "write_tflite_int8"]


class UnsupportedOp(VariantBuildError):
    """The graph has an op (or an op use) the TFLite writer does not lower."""

    def __init__(self, op: str, node: str, why: str = "unsupported op") -> None:
        super().__init__(f"TFLite writer: {why} {op} at node '{node}'", op=op, node=node)
        self.op, self.node = op, node


@dataclass
class DenseLayer:
    weight: np.ndarray   # (out, in) float32, TFLite's FULLY_CONNECTED layout
    bias: np.ndarray     # (out,) float32
    relu: bool
    name: str


def extract_dense_chain(model: onnx.ModelProto) -> tuple[str, str, list[DenseLayer]]:
    """(input name, output name, layers) of a dense-only graph; raises ``UnsupportedOp`` otherwise."""
    bad = first_unsupported(model, TFLITE_WRITER_OPS)
    if bad is not None:
        raise UnsupportedOp(*bad)
    g = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    init_names = set(consts)
    inputs = [i for i in g.input if i.name not in init_names]
    if len(inputs) != 1 or len(g.output) != 1:
        raise VariantBuildError("TFLite writer: needs exactly one graph input and one output")
    alias = {inputs[0].name: inputs[0].name}  # ONNX tensor -> the chain's current activation
    current = inputs[0].name
    layers: list[DenseLayer] = []
    pending_matmul: DenseLayer | None = None
    for node in g.node:
        op, name = node.op_type, node.name or node.output[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if op == "Constant":
            consts[node.output[0]] = numpy_helper.to_array(attrs["value"])
            continue
        act = [i for i in node.input if i and i not in consts]
        if len(act) != 1 or alias.get(act[0]) != current:
            raise UnsupportedOp(op, name, "non-sequential use of")
        if op in ("Flatten", "Reshape", "Identity"):
            # Only 2-D -> 2-D glue is a no-op here; a 4-D reshape would feed convs, refused above.
            if op == "Reshape" and len(consts.get(node.input[1], [])) != 2:
                raise UnsupportedOp(op, name, "non 2-D")
        elif op == "Gemm":
            if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
                raise UnsupportedOp(op, name, "scaled or transposed-A")
            w = consts[node.input[1]].astype(np.float32)
            w = w if attrs.get("transB", 0) else w.T
            b = (consts[node.input[2]].astype(np.float32) if len(node.input) > 2 and node.input[2]
                 else np.zeros(w.shape[0], np.float32))
            layers.append(DenseLayer(np.ascontiguousarray(w), b.reshape(-1), False, name))
        elif op == "MatMul":
            w = np.ascontiguousarray(consts[node.input[1]].astype(np.float32).T)
            pending_matmul = DenseLayer(w, np.zeros(w.shape[0], np.float32), False, name)
            layers.append(pending_matmul)
        elif op == "Add":
            if pending_matmul is None or layers[-1] is not pending_matmul:
                raise UnsupportedOp(op, name, "Add not following a MatMul:")
            bias_name = next(i for i in node.input if i in consts)
            pending_matmul.bias = consts[bias_name].astype(np.float32).reshape(-1)
            pending_matmul = None
        elif op == "Relu":
            if not layers or layers[-1].relu:
                raise UnsupportedOp(op, name, "Relu not following a dense layer:")
            layers[-1].relu = True
        current = node.output[0]
        alias[current] = current
    if alias.get(g.output[0].name) != current or not layers:
        raise VariantBuildError("TFLite writer: the graph output is not the end of a dense chain")
    return inputs[0].name, g.output[0].name, layers


def _float_chain(layers: list[DenseLayer], x: np.ndarray) -> list[np.ndarray]:
    acts = [x.astype(np.float32)]
    for layer in layers:
        z = acts[-1] @ layer.weight.T + layer.bias
        acts.append(np.maximum(z, 0) if layer.relu else z)
    return acts


def _act_qparams(a: np.ndarray) -> tuple[float, int]:
    lo, hi = min(float(a.min()), 0.0), max(float(a.max()), 0.0)
    scale = (hi - lo) / 255.0 if hi > lo else 1.0
    zero = int(np.clip(round(-128 - lo / scale), -128, 127))
    return scale, zero


def _check_against_onnx(model_bytes: bytes, in_name: str, out_name: str, x: np.ndarray,
                        ref: np.ndarray) -> None:
    import onnxruntime as ort

    sess = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    got = sess.run([out_name], {in_name: x})[0]
    if not np.allclose(got, ref, rtol=1e-3, atol=1e-3):
        raise VariantBuildError("TFLite writer: float chain disagrees with ONNX Runtime; graph misread")


def write_tflite_int8(parent: Path, calib_x: np.ndarray, out: Path, *, per_channel: bool = True) -> Path:
    """Write ``out`` as a full-integer INT8 TFLite model of the dense ONNX model at ``parent``."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as s

    if len(calib_x) == 0:
        raise VariantBuildError("TFLite writer: calibration inputs are empty")
    model_bytes = Path(parent).read_bytes()
    in_name, out_name, layers = extract_dense_chain(onnx.load_from_string(model_bytes))
    x = np.ascontiguousarray(calib_x, dtype=np.float32)
    acts = _float_chain(layers, x)
    _check_against_onnx(model_bytes, in_name, out_name, x, acts[-1])

    buffers = [s.BufferT()]  # buffer 0 is the conventional empty one for activations
    tensors: list[s.TensorT] = []

    def add_tensor(name: str, shape: list[int], ttype: int, q: s.QuantizationParametersT,
                   data: np.ndarray | None = None, dynamic_batch: bool = False) -> int:
        buf = 0
        if data is not None:
            b = s.BufferT()
            b.data = np.frombuffer(np.ascontiguousarray(data).tobytes(), dtype=np.uint8)
            buffers.append(b)
            buf = len(buffers) - 1
        t = s.TensorT()
        t.name, t.shape, t.type, t.buffer, t.quantization = name, shape, ttype, buf, q
        if dynamic_batch:
            t.shapeSignature = [-1, *shape[1:]]
        tensors.append(t)
        return len(tensors) - 1

    def qp(scale: list[float], zero: list[int], dim: int = 0) -> s.QuantizationParametersT:
        q = s.QuantizationParametersT()
        q.scale, q.zeroPoint, q.quantizedDimension = scale, zero, dim
        return q

    in_scale, in_zero = _act_qparams(acts[0])
    cur = add_tensor(in_name, [1, layers[0].weight.shape[1]], s.TensorType.INT8,
                     qp([in_scale], [in_zero]), dynamic_batch=True)
    cur_scale = in_scale
    ops: list[s.OperatorT] = []
    for i, layer in enumerate(layers):
        w = layer.weight.astype(np.float64)
        absmax = np.abs(w).max(axis=1) if per_channel else np.full(w.shape[0], np.abs(w).max())
        w_scale = np.where(absmax > 0, absmax / 127.0, 1.0)
        wq = np.clip(np.round(w / w_scale[:, None]), -127, 127).astype(np.int8)
        b_scale = cur_scale * w_scale
        bq = np.round(layer.bias.astype(np.float64) / b_scale).astype(np.int32)
        w_scales = [float(v) for v in (w_scale if per_channel else w_scale[:1])]
        b_scales = [float(v) for v in (b_scale if per_channel else b_scale[:1])]
        wt = add_tensor(f"{layer.name}.weight", list(wq.shape), s.TensorType.INT8,
                        qp(w_scales, [0] * len(w_scales)), data=wq)
        bt = add_tensor(f"{layer.name}.bias", [wq.shape[0]], s.TensorType.INT32,
                        qp(b_scales, [0] * len(b_scales)), data=bq)
        o_scale, o_zero = _act_qparams(acts[i + 1])
        last = i == len(layers) - 1
        ot = add_tensor(out_name if last else f"{layer.name}.out", [1, wq.shape[0]], s.TensorType.INT8,
                        qp([o_scale], [o_zero]), dynamic_batch=True)
        opts = s.FullyConnectedOptionsT()
        opts.fusedActivationFunction = (s.ActivationFunctionType.RELU if layer.relu
                                        else s.ActivationFunctionType.NONE)
        op = s.OperatorT()
        op.opcodeIndex, op.inputs, op.outputs = 0, [cur, wt, bt], [ot]
        op.builtinOptionsType, op.builtinOptions = s.BuiltinOptions.FullyConnectedOptions, opts
        ops.append(op)
        cur, cur_scale = ot, o_scale

    code = s.OperatorCodeT()
    code.builtinCode = code.deprecatedBuiltinCode = s.BuiltinOperator.FULLY_CONNECTED
    code.version = 4  # the int8 FULLY_CONNECTED kernel version
    sub = s.SubGraphT()
    sub.tensors, sub.inputs, sub.outputs, sub.operators, sub.name = tensors, [0], [cur], ops, "main"
    sig = s.SignatureDefT()
    sig.signatureKey, sig.subgraphIndex = "serving_default", 0
    sig.inputs = [_tmap(s, in_name, 0)]
    sig.outputs = [_tmap(s, out_name, cur)]
    m = s.ModelT()
    m.version, m.operatorCodes, m.subgraphs, m.buffers = 3, [code], [sub], buffers
    m.description, m.signatureDefs = "tiermesh tflite int8 writer", [sig]
    builder = flatbuffers.Builder(1024)
    builder.Finish(m.Pack(builder), file_identifier=b"TFL3")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(bytes(builder.Output()))
    return out


def _tmap(s: object, name: str, index: int) -> object:
    t = s.TensorMapT()  # type: ignore[attr-defined]
    t.name, t.tensorIndex = name, index
    return t
