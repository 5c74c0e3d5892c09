"""Serialise a lowered, calibrated layer chain as a full-integer INT8 ``.tflite`` flatbuffer.

Built with the object API of the installed ``ai_edge_litert.schema_py_generated`` (never a copy
of the schema). Tensors, buffers and operator codes are appended in chain order and nothing is
keyed by hash or time, so the same layers and scales always give the same bytes. Every
activation keeps a dynamic batch (``shape_signature`` -1) so ``TFLiteRuntime`` can resize it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mesh.errors import VariantBuildError
from variant_store.generate.tflite_lower import ConvLayer, DenseLayer, Layer, PoolLayer, padding_mode

__all__ = ["OP_VERSIONS", "emit_int8_model"]

# The lowest kernel version of each builtin that takes int8 (per-channel for CONV_2D).
OP_VERSIONS: dict[str, int] = {"FULLY_CONNECTED": 4, "CONV_2D": 3, "MAX_POOL_2D": 2, "RESHAPE": 1, "PAD": 2}


class _Model:
    """The growing tensor / buffer / opcode tables of one subgraph."""

    def __init__(self, s: Any) -> None:
        self.s = s
        self.buffers: list[Any] = [s.BufferT()]  # buffer 0: the conventional empty one
        self.tensors: list[Any] = []
        self.ops: list[Any] = []
        self.codes: list[str] = []

    def qp(self, scale: list[float], zero: list[int], dim: int = 0) -> Any:
        q = self.s.QuantizationParametersT()
        q.scale, q.zeroPoint, q.quantizedDimension = scale, zero, dim
        return q

    def tensor(self, name: str, shape: list[int], ttype: int, q: Any, data: np.ndarray | None = None,
               dynamic_batch: bool = False) -> int:
        buf = 0
        if data is not None:
            b = self.s.BufferT()
            b.data = np.frombuffer(np.ascontiguousarray(data).tobytes(), dtype=np.uint8)
            self.buffers.append(b)
            buf = len(self.buffers) - 1
        t = self.s.TensorT()
        t.name, t.shape, t.type, t.buffer, t.quantization = name, shape, ttype, buf, q
        if dynamic_batch:
            t.shapeSignature = [-1, *shape[1:]]
        self.tensors.append(t)
        return len(self.tensors) - 1

    def act(self, name: str, shape: list[int], q: tuple[float, int]) -> int:
        return self.tensor(name, shape, self.s.TensorType.INT8, self.qp([q[0]], [q[1]]), dynamic_batch=True)

    def const_i32(self, name: str, values: np.ndarray) -> int:
        v = np.asarray(values, dtype=np.int32)
        return self.tensor(name, list(v.shape), self.s.TensorType.INT32, None, data=v)

    def op(self, builtin: str, inputs: list[int], outputs: list[int], opts_type: int, opts: Any) -> None:
        if builtin not in self.codes:
            self.codes.append(builtin)
        o = self.s.OperatorT()
        o.opcodeIndex, o.inputs, o.outputs = self.codes.index(builtin), inputs, outputs
        o.builtinOptionsType, o.builtinOptions = opts_type, opts
        self.ops.append(o)

    def weights(self, name: str, w: np.ndarray, bias: np.ndarray, in_scale: float,
                per_channel: bool) -> tuple[int, int]:
        """Symmetric int8 weights per output channel (axis 0) and int32 bias at in x w scale."""
        w64 = w.astype(np.float64)
        flat = np.abs(w64.reshape(w64.shape[0], -1))
        absmax = flat.max(axis=1) if per_channel else np.full(w64.shape[0], flat.max())
        w_scale = np.where(absmax > 0, absmax / 127.0, 1.0)
        bshape = (-1,) + (1,) * (w64.ndim - 1)
        wq = np.clip(np.round(w64 / w_scale.reshape(bshape)), -127, 127).astype(np.int8)
        b_scale = in_scale * w_scale
        bq = np.round(bias.astype(np.float64) / b_scale).astype(np.int32)
        n = len(w_scale) if per_channel else 1
        w_scales, b_scales = [float(v) for v in w_scale[:n]], [float(v) for v in b_scale[:n]]
        wt = self.tensor(f"{name}.weight", list(wq.shape), self.s.TensorType.INT8,
                         self.qp(w_scales, [0] * n), data=wq)
        bt = self.tensor(f"{name}.bias", [wq.shape[0]], self.s.TensorType.INT32,
                         self.qp(b_scales, [0] * n), data=bq)
        return wt, bt

    def fused(self, relu: bool) -> int:
        f = self.s.ActivationFunctionType
        return int(f.RELU if relu else f.NONE)


def emit_int8_model(layers: list[Layer], qparams: list[tuple[float, int]], in_name: str, out_name: str,
                    in_features: int, *, per_channel: bool = True) -> bytes:
    """The ``.tflite`` bytes; ``qparams[i]`` is (scale, zero point) of float activation i (0 = input)."""
    from ai_edge_litert import schema_py_generated as s

    m = _Model(s)
    cur_q = qparams[0]
    cur = m.act(in_name, [1, in_features], cur_q)
    shape = [1, in_features]
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        oname = out_name if last else f"{layer.name}.out"
        if isinstance(layer, DenseLayer):
            wt, bt = m.weights(layer.name, layer.weight, layer.bias, cur_q[0], per_channel)
            shape, cur_q = [1, layer.weight.shape[0]], qparams[i + 1]
            ot = m.act(oname, shape, cur_q)
            opts = s.FullyConnectedOptionsT()
            opts.fusedActivationFunction = m.fused(layer.relu)
            m.op("FULLY_CONNECTED", [cur, wt, bt], [ot], s.BuiltinOptions.FullyConnectedOptions, opts)
        elif isinstance(layer, ConvLayer):
            cur, shape, pad = _pad_if_needed(m, layer, cur, shape, cur_q)
            wt, bt = m.weights(layer.name, layer.weight, layer.bias, cur_q[0], per_channel)
            kh, kw = layer.weight.shape[1:3]
            shape, cur_q = _out_shape(shape, (kh, kw), layer.strides, pad, layer.weight.shape[0]), qparams[i + 1]
            ot = m.act(oname, shape, cur_q)
            copts = s.Conv2DOptionsT()
            copts.padding = getattr(s.Padding, pad)
            copts.strideH, copts.strideW = layer.strides
            copts.dilationHFactor = copts.dilationWFactor = 1
            copts.fusedActivationFunction = m.fused(layer.relu)
            m.op("CONV_2D", [cur, wt, bt], [ot], s.BuiltinOptions.Conv2DOptions, copts)
        elif isinstance(layer, PoolLayer):
            ppad = padding_mode((shape[1], shape[2]), layer.kernel, layer.strides, layer.pads)
            if ppad is None:  # ONNX pads with -inf here; an int8 PAD cannot, so the reader refuses
                raise VariantBuildError(f"TFLite writer: MaxPool {layer.name} padding is not SAME/VALID")
            shape = _out_shape(shape, layer.kernel, layer.strides, ppad, shape[3])
            ot = m.act(oname, shape, cur_q)  # int8 MAX_POOL_2D keeps its input's scale
            popts = s.Pool2DOptionsT()
            popts.padding = getattr(s.Padding, ppad)
            popts.strideH, popts.strideW = layer.strides
            popts.filterHeight, popts.filterWidth = layer.kernel
            popts.fusedActivationFunction = m.fused(False)
            m.op("MAX_POOL_2D", [cur], [ot], s.BuiltinOptions.Pool2DOptions, popts)
        else:
            new_shape = [-1, *layer.shape]
            st = m.const_i32(f"{layer.name}.shape", np.array(new_shape))
            shape = [1, *layer.shape]
            ot = m.act(oname, shape, cur_q)  # a reshape moves no values, so its scale is its input's
            ropts = s.ReshapeOptionsT()
            ropts.newShape = new_shape
            m.op("RESHAPE", [cur, st], [ot], s.BuiltinOptions.ReshapeOptions, ropts)
        cur = ot
    return _finish(s, m, in_name, out_name, cur)


def _pad_if_needed(m: _Model, layer: ConvLayer, cur: int, shape: list[int],
                   q: tuple[float, int]) -> tuple[int, list[int], str]:
    """Where TFLite's SAME / VALID is not ONNX's ``pads``, an explicit PAD (with the zero point,
    i.e. real 0.0, as ONNX pads a conv) and then a VALID conv."""
    kh, kw = layer.weight.shape[1:3]
    pad = padding_mode((shape[1], shape[2]), (kh, kw), layer.strides, layer.pads)
    if pad is not None:
        return cur, shape, pad
    t, left, b, r = layer.pads
    pt = m.const_i32(f"{layer.name}.paddings", np.array([[0, 0], [t, b], [left, r], [0, 0]]))
    shape = [1, shape[1] + t + b, shape[2] + left + r, shape[3]]
    ot = m.act(f"{layer.name}.padded", shape, q)
    m.op("PAD", [cur, pt], [ot], m.s.BuiltinOptions.PadOptions, m.s.PadOptionsT())
    return ot, shape, "VALID"


def _out_shape(shape: list[int], kernel: tuple[int, int], strides: tuple[int, int], pad: str,
               channels: int) -> list[int]:
    if pad == "SAME":
        return [1, -(-shape[1] // strides[0]), -(-shape[2] // strides[1]), channels]
    return [1, (shape[1] - kernel[0]) // strides[0] + 1, (shape[2] - kernel[1]) // strides[1] + 1, channels]


def _finish(s: Any, m: _Model, in_name: str, out_name: str, out_index: int) -> bytes:
    import flatbuffers

    codes = []
    for name in m.codes:
        code = s.OperatorCodeT()
        code.builtinCode = code.deprecatedBuiltinCode = getattr(s.BuiltinOperator, name)
        code.version = OP_VERSIONS[name]
        codes.append(code)
    sub = s.SubGraphT()
    sub.tensors, sub.inputs, sub.outputs, sub.operators, sub.name = m.tensors, [0], [out_index], m.ops, "main"
    sig = s.SignatureDefT()
    sig.signatureKey, sig.subgraphIndex = "serving_default", 0
    sig.inputs, sig.outputs = [_tmap(s, in_name, 0)], [_tmap(s, out_name, out_index)]
    model = s.ModelT()
    model.version, model.operatorCodes, model.subgraphs, model.buffers = 3, codes, [sub], m.buffers
    model.description, model.signatureDefs = "tiermesh tflite int8 writer", [sig]
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _tmap(s: Any, name: str, index: int) -> Any:
    t = s.TensorMapT()
    t.name, t.tensorIndex = name, index
    return t
