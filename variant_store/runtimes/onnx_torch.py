"""ONNX graphs run as PyTorch code: the op set of the digits family and of the MiniLM export.

A small interpreter rather than a general converter: the graph's nodes become a list of torch
calls, executed in order over a dict of named tensors. It covers the ops our families use (Gemm /
Conv / MaxPool for digits; MatMul, Gather, LayerNormalization, Softmax, Erf, shape arithmetic for
the BERT export) and refuses anything else at load time, naming the op, rather than at the first
query.

Placement rules (why the shape arithmetic stays on the CPU): ``Shape`` and small integer constants
are CPU int64 tensors, so ``Reshape`` / ``Expand`` / ``Slice`` read their targets with no device
sync, which also keeps a forward pass capturable as a CUDA graph. Everything else lives on the
target device. In FP16 mode float weights and ``Cast(to=float)`` become half precision, float
constants are clamped to the half range first (BERT's additive mask uses float32's minimum, which
would turn into ``-inf`` and then ``0 * -inf = NaN``), and graph outputs are cast back to the dtype
the graph declares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mesh.errors import RuntimeLoadError
from mesh.types import TensorSpec

__all__ = ["SUPPORTED_OPS", "TorchGraph", "graph_specs"]

_SMALL_INT = 64  # integer constants up to this many elements are shape data: keep them on the CPU

# ONNX TensorProto element types -> numpy dtype names (the subset our models use)
_ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
                11: "float64"}


def _spec(value_info: Any) -> TensorSpec:
    t = value_info.type.tensor_type
    dims = tuple(int(d.dim_value) if d.HasField("dim_value") else -1 for d in t.shape.dim)
    return TensorSpec(value_info.name, _ONNX_DTYPES.get(t.elem_type, f"onnx-{t.elem_type}"), dims)


def graph_specs(model: Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of an ``onnx.ModelProto``; initializers listed as inputs are left out."""
    inits = {i.name for i in model.graph.initializer}
    return ([_spec(v) for v in model.graph.input if v.name not in inits], [_spec(v) for v in model.graph.output])


@dataclass(slots=True)
class _Node:
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    fn: Callable[..., Any]


def _topological(graph: Any) -> list[Any]:
    """The graph's nodes in an order where every input is produced before it is read. ONNX asks for that
    order, but float16 converters append the casts of the graph's inputs at the end (ONNX Runtime sorts
    anyway); a stable Kahn's order keeps the file's order wherever it already holds."""
    ready = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending = list(graph.node)
    out: list[Any] = []
    while pending:
        rest = []
        for n in pending:
            if all(name in ready for name in n.input):
                out.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):  # a cycle, or an input nothing produces
            missing = sorted({name for n in rest for name in n.input if name not in ready})
            raise RuntimeLoadError(f"torch runtime: graph inputs never produced: {missing[:5]}")
        pending = rest
    return out


class TorchGraph:
    """An ONNX model as a callable over torch tensors on ``device``, in ``float32`` or ``float16``."""

    def __init__(self, model: Any, device: str = "cuda", half: bool = False) -> None:
        import onnx
        import torch
        from onnx import numpy_helper

        self.torch = torch
        self.device = torch.device(device)
        self.half = half
        self.float_dtype = torch.float16 if half else torch.float32
        self.input_specs, self.output_specs = graph_specs(model)
        self.consts: dict[str, Any] = {}
        for init in model.graph.initializer:
            self.consts[init.name] = self._const(numpy_helper.to_array(init))
        self.nodes: list[_Node] = []
        for n in _topological(model.graph):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            if n.op_type == "Constant":
                self.consts[n.output[0]] = self._const(numpy_helper.to_array(attrs["value"]))
                continue
            fn = _OPS.get(n.op_type)
            if fn is None:
                raise RuntimeLoadError(f"torch runtime: unsupported ONNX op {n.op_type} (node {n.name!r}); "
                                       f"supported: {sorted(SUPPORTED_OPS)}", op=n.op_type)
            self.nodes.append(_Node(n.op_type, list(n.input), list(n.output), attrs, fn))
        self._fold_constants()
        out_dtypes = {s.name: getattr(torch, s.dtype) for s in self.output_specs}
        self._out_dtypes = out_dtypes

    # -- constants -------------------------------------------------------------------------------
    def _const(self, arr: np.ndarray) -> Any:
        torch = self.torch
        if arr.dtype.kind == "f":
            if self.half:
                arr = np.clip(arr, -65504.0, 65504.0)
            return torch.from_numpy(np.array(arr)).to(self.device, self.float_dtype)
        t = torch.from_numpy(np.array(arr))
        return t if t.numel() <= _SMALL_INT and arr.dtype.kind in "iub" else t.to(self.device)

    def _fold_constants(self) -> None:
        """Run once, at load, every node whose inputs are all constants (shape arithmetic, mostly)."""
        live: list[_Node] = []
        for node in self.nodes:
            if all(not name or name in self.consts for name in node.inputs):
                outs = self._call(node, self.consts)
                for name, value in zip(node.outputs, outs, strict=False):
                    self.consts[name] = value
            else:
                live.append(node)
        self.nodes = live

    # -- execution -------------------------------------------------------------------------------
    def _call(self, node: _Node, env: dict[str, Any]) -> Sequence[Any]:
        args = [env[name] if name else None for name in node.inputs]
        try:
            out = node.fn(self, args, node.attrs)
        except RuntimeLoadError:
            raise
        except Exception as exc:
            raise RuntimeLoadError(f"torch runtime: {node.op} failed: {exc}", op=node.op) from exc
        return out if isinstance(out, tuple) else (out,)

    def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run the graph on tensors already on the device; returns the declared outputs."""
        env = dict(self.consts)
        for spec in self.input_specs:
            t = inputs[spec.name]
            env[spec.name] = t.to(self.float_dtype) if t.is_floating_point() else t
        for node in self.nodes:
            for name, value in zip(node.outputs, self._call(node, env), strict=False):
                env[name] = value
        return {s.name: env[s.name].to(self._out_dtypes[s.name]) for s in self.output_specs}

    # -- helpers for the op table ---------------------------------------------------------------
    def same_device(self, a: Any, b: Any) -> tuple[Any, Any]:
        """Move a CPU operand next to a device operand (0-d CPU tensors mix with CUDA ones natively)."""
        if a.device != b.device:
            # a one-element CPU tensor becomes a 0-d one: torch reads it as a scalar, no host-to-device
            # copy (a copy from pageable memory cannot be captured in a CUDA graph)
            if a.device.type == "cpu" and a.numel() == 1 and b.dim() >= a.dim():
                a = a.reshape(())
            elif b.device.type == "cpu" and b.numel() == 1 and a.dim() >= b.dim():
                b = b.reshape(())
            if a.device.type == "cpu" and a.dim() > 0:
                a = a.to(b.device)
            elif b.device.type == "cpu" and b.dim() > 0:
                b = b.to(a.device)
        return a, b


def _ints(t: Any) -> list[int]:
    return [int(v) for v in (t.tolist() if hasattr(t, "tolist") else t)]


def _binary(f: Callable[[Any, Any], Any]) -> Callable[[TorchGraph, list[Any], dict[str, Any]], Any]:
    def op(g: TorchGraph, a: list[Any], _: dict[str, Any]) -> Any:
        x, y = g.same_device(a[0], a[1])
        return f(x, y)
    return op


def _gemm(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    x, w = a[0], a[1]
    if at.get("transA", 0):
        x = x.t()
    if at.get("transB", 0):
        w = w.t()
    alpha, beta = float(at.get("alpha", 1.0)), float(at.get("beta", 1.0))
    if len(a) > 2 and a[2] is not None:
        return g.torch.addmm(a[2], x, w, beta=beta, alpha=alpha)
    return g.torch.mm(x, w) * alpha if alpha != 1.0 else g.torch.mm(x, w)


def _pads2d(at: dict[str, Any]) -> tuple[int, int]:
    pads = list(at.get("pads", [0, 0, 0, 0]))
    if len(pads) != 4 or pads[0] != pads[2] or pads[1] != pads[3]:
        raise RuntimeLoadError(f"torch runtime: only symmetric 2-D padding is supported, got {pads}")
    if at.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise RuntimeLoadError("torch runtime: auto_pad is not supported")
    return pads[0], pads[1]


def _conv(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    bias = a[2] if len(a) > 2 else None
    return g.torch.nn.functional.conv2d(a[0], a[1], bias, stride=tuple(at.get("strides", [1, 1])),
                                        padding=_pads2d(at), dilation=tuple(at.get("dilations", [1, 1])),
                                        groups=int(at.get("group", 1)))


def _maxpool(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    k = tuple(at["kernel_shape"])
    return g.torch.nn.functional.max_pool2d(a[0], k, stride=tuple(at.get("strides", k)), padding=_pads2d(at),
                                            dilation=tuple(at.get("dilations", [1, 1])),
                                            ceil_mode=bool(at.get("ceil_mode", 0)))


def _reshape(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    shape = _ints(a[1])
    if not at.get("allowzero", 0):
        shape = [a[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return a[0].reshape(shape)


def _flatten(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    axis = int(at.get("axis", 1))
    axis = axis + a[0].dim() if axis < 0 else axis  # axis == rank is legal: (N, L) at 2 -> (N*L, 1)
    return a[0].reshape(math.prod(a[0].shape[:axis]), math.prod(a[0].shape[axis:]))


def _axes(a: list[Any], at: dict[str, Any], idx: int = 1) -> list[int] | None:
    if len(a) > idx and a[idx] is not None:
        return _ints(a[idx])
    return list(at["axes"]) if "axes" in at else None


def _unsqueeze(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    x = a[0]
    for ax in sorted(d % (x.dim() + len(_axes(a, at) or [])) for d in _axes(a, at) or []):
        x = x.unsqueeze(ax)
    return x


def _squeeze(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    axes = _axes(a, at)
    return a[0].squeeze() if axes is None else a[0].squeeze(tuple(axes))


def _reduce(name: str) -> Callable[[TorchGraph, list[Any], dict[str, Any]], Any]:
    def op(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
        axes = _axes(a, at)
        keep = bool(at.get("keepdims", 1))
        if axes is None or not axes:
            axes = list(range(a[0].dim()))
        return getattr(a[0], name)(dim=tuple(axes), keepdim=keep)
    return op


def _reduce_l2(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    axes = _axes(a, at) or list(range(a[0].dim()))
    return g.torch.linalg.vector_norm(a[0], dim=tuple(axes), keepdim=bool(at.get("keepdims", 1)))


def _gather(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    data, idx = a[0], a[1]
    axis = int(at.get("axis", 0)) % data.dim()
    if idx.device != data.device and idx.numel() == 1:  # a shape-derived position: index without a copy
        i = int(idx.reshape(-1)[0])
        i = i + data.shape[axis] if i < 0 else i
        return data.select(axis, i) if idx.dim() == 0 else data.narrow(axis, i, 1).reshape(
            (*data.shape[:axis], *idx.shape, *data.shape[axis + 1:]))
    if idx.device != data.device:
        idx = idx.to(data.device)
    idx = idx.long()
    idx = g.torch.where(idx < 0, idx + data.shape[axis], idx)
    if axis == 0 and data.dim() >= 1:
        return data[idx]
    return g.torch.index_select(data, axis, idx.reshape(-1)).reshape(
        (*data.shape[:axis], *idx.shape, *data.shape[axis + 1:]))


def _shape(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    dims = list(a[0].shape)[int(at.get("start", 0)):at.get("end")]
    return g.torch.tensor(dims, dtype=g.torch.int64)


def _cast(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    to = _ONNX_DTYPES.get(int(at["to"]))
    if to is None:
        raise RuntimeLoadError(f"torch runtime: Cast to ONNX type {at['to']} is not supported")
    dtype = g.float_dtype if to in ("float32", "float16") else getattr(g.torch, to)
    return a[0].to(dtype)


def _concat(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    parts = [t for t in a if t is not None]
    dev = next((t.device for t in parts if t.device.type != "cpu"), parts[0].device)
    return g.torch.cat([t.to(dev) for t in parts], dim=int(at["axis"]))


def _slice(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    x = a[0]
    starts, ends = _ints(a[1]), _ints(a[2])
    axes = _ints(a[3]) if len(a) > 3 and a[3] is not None else list(range(len(starts)))
    steps = _ints(a[4]) if len(a) > 4 and a[4] is not None else [1] * len(starts)
    index: list[slice] = [slice(None)] * x.dim()
    for s, e, ax, st in zip(starts, ends, axes, steps, strict=True):
        if st <= 0:
            raise RuntimeLoadError("torch runtime: Slice with a non-positive step is not supported")
        n = x.shape[ax]
        index[ax % x.dim()] = slice(max(0, min(n, s + n if s < 0 else s)), max(0, min(n, e + n if e < 0 else e)), st)
    return x[tuple(index)]


def _expand(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    shape = _ints(a[1])
    x = a[0]
    nd = max(x.dim(), len(shape))
    xs = [1] * (nd - x.dim()) + list(x.shape)
    ts = [1] * (nd - len(shape)) + shape
    target = [max(p, q) if 1 in (p, q) else p for p, q in zip(xs, ts, strict=True)]
    return x.reshape(xs).expand(target)


def _const_of_shape(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    from onnx import numpy_helper

    value = numpy_helper.to_array(at["value"]) if "value" in at else np.zeros(1, np.float32)
    dtype = g.float_dtype if value.dtype.kind == "f" else getattr(g.torch, value.dtype.name)
    shape = _ints(a[0])
    device = "cpu" if value.dtype.kind in "iub" and math.prod(shape) <= _SMALL_INT else g.device
    return g.torch.full(shape, value.reshape(-1)[0].item(), dtype=dtype, device=device)


def _where(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    c, x, y = a
    dev = next((t.device for t in (c, x, y) if t.device.type != "cpu"), c.device)
    return g.torch.where(c.to(dev), x.to(dev), y.to(dev))


def _layer_norm(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    axis = int(at.get("axis", -1)) % a[0].dim()
    shape = tuple(a[0].shape[axis:])
    bias = a[2] if len(a) > 2 else None
    return g.torch.nn.functional.layer_norm(a[0], shape, a[1], bias, float(at.get("epsilon", 1e-5)))


def _softmax(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    return g.torch.softmax(a[0], dim=int(at.get("axis", -1)))


def _clip(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    lo = a[1].item() if len(a) > 1 and a[1] is not None else None
    hi = a[2].item() if len(a) > 2 and a[2] is not None else None
    return a[0].clamp(lo, hi)


def _range(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    start, limit, delta = (t.item() for t in a)
    return g.torch.arange(start, limit, delta, dtype=a[0].dtype, device=a[0].device)


def _pow(g: TorchGraph, a: list[Any], at: dict[str, Any]) -> Any:
    e = a[1]
    if e.numel() == 1:
        v = e.item()
        return a[0] * a[0] if v == 2 else a[0] ** v
    x, y = g.same_device(a[0], e)
    return x ** y


def _div(x: Any, y: Any) -> Any:
    if x.is_floating_point() or y.is_floating_point():
        return x / y
    return x // y  # ONNX integer Div truncates; our graphs only divide non-negative shape values


_OPS: dict[str, Callable[[TorchGraph, list[Any], dict[str, Any]], Any]] = {
    "Identity": lambda g, a, at: a[0],
    "Relu": lambda g, a, at: g.torch.relu(a[0]),
    "Sigmoid": lambda g, a, at: g.torch.sigmoid(a[0]),
    "Tanh": lambda g, a, at: g.torch.tanh(a[0]),
    "Erf": lambda g, a, at: g.torch.erf(a[0]),
    "Sqrt": lambda g, a, at: g.torch.sqrt(a[0]),
    "Neg": lambda g, a, at: -a[0],
    "Not": lambda g, a, at: g.torch.logical_not(a[0]),
    "Gemm": _gemm,
    "MatMul": _binary(lambda x, y: x @ y),
    "Add": _binary(lambda x, y: x + y),
    "Sub": _binary(lambda x, y: x - y),
    "Mul": _binary(lambda x, y: x * y),
    "Div": _binary(_div),
    "Equal": _binary(lambda x, y: x == y),
    "Less": _binary(lambda x, y: x < y),
    "LessOrEqual": _binary(lambda x, y: x <= y),
    "GreaterOrEqual": _binary(lambda x, y: x >= y),
    "And": _binary(lambda x, y: x & y),
    "Or": _binary(lambda x, y: x | y),
    "Greater": _binary(lambda x, y: x > y),
    "Max": _binary(lambda x, y: x.maximum(y)),
    "Min": _binary(lambda x, y: x.minimum(y)),
    "Pow": _pow,
    "Conv": _conv,
    "MaxPool": _maxpool,
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": lambda g, a, at: a[0].permute(*at["perm"]) if "perm" in at else a[0].permute(
        *reversed(range(a[0].dim()))),
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Gather": _gather,
    "Shape": _shape,
    "Cast": _cast,
    "Concat": _concat,
    "Slice": _slice,
    "Expand": _expand,
    "ConstantOfShape": _const_of_shape,
    "Where": _where,
    "Softmax": _softmax,
    "LayerNormalization": _layer_norm,
    "ReduceMean": _reduce("mean"),
    "ReduceSum": _reduce("sum"),
    "ReduceMax": _reduce("amax"),
    "ReduceL2": _reduce_l2,
    "Clip": _clip,
    "Range": _range,
}
SUPPORTED_OPS: frozenset[str] = frozenset({*_OPS, "Constant"})
