"""The ONNX ops :class:`~variant_store.runtimes.onnx_torch.TorchGraph` runs, each as torch calls: ``OPS`` maps an
op type to ``f(graph, inputs, attributes) -> output(s)``. What an op needs of the graph is :class:`Graph` (torch
itself, the target device, the float dtype, and moving two operands to one device)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from mesh.errors import RuntimeLoadError

__all__ = ["ONNX_DTYPES", "OPS", "SMALL_INT", "SUPPORTED_OPS", "Graph"]

SMALL_INT = 64  # integer constants up to this many elements are shape data: keep them on the CPU

# ONNX TensorProto element types -> numpy dtype names (the subset our models use)
ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
                11: "float64"}


class Graph(Protocol):
    torch: Any
    device: Any
    float_dtype: Any

    def same_device(self, a: Any, b: Any) -> tuple[Any, Any]: ...


def _ints(t: Any) -> list[int]:
    return [int(v) for v in (t.tolist() if hasattr(t, "tolist") else t)]


def _binary(f: Callable[[Any, Any], Any]) -> Callable[[Graph, list[Any], dict[str, Any]], Any]:
    def op(g: Graph, a: list[Any], _: dict[str, Any]) -> Any:
        x, y = g.same_device(a[0], a[1])
        return f(x, y)
    return op


def _gemm(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
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


def _conv(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    bias = a[2] if len(a) > 2 else None
    return g.torch.nn.functional.conv2d(a[0], a[1], bias, stride=tuple(at.get("strides", [1, 1])),
                                        padding=_pads2d(at), dilation=tuple(at.get("dilations", [1, 1])),
                                        groups=int(at.get("group", 1)))


def _maxpool(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    k = tuple(at["kernel_shape"])
    return g.torch.nn.functional.max_pool2d(a[0], k, stride=tuple(at.get("strides", k)), padding=_pads2d(at),
                                            dilation=tuple(at.get("dilations", [1, 1])),
                                            ceil_mode=bool(at.get("ceil_mode", 0)))


def _reshape(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    shape = _ints(a[1])
    if not at.get("allowzero", 0):
        shape = [a[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return a[0].reshape(shape)


def _flatten(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    axis = int(at.get("axis", 1))
    axis = axis + a[0].dim() if axis < 0 else axis  # axis == rank is legal: (N, L) at 2 -> (N*L, 1)
    return a[0].reshape(math.prod(a[0].shape[:axis]), math.prod(a[0].shape[axis:]))


def _axes(a: list[Any], at: dict[str, Any], idx: int = 1) -> list[int] | None:
    if len(a) > idx and a[idx] is not None:
        return _ints(a[idx])
    return list(at["axes"]) if "axes" in at else None


def _unsqueeze(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    x = a[0]
    for ax in sorted(d % (x.dim() + len(_axes(a, at) or [])) for d in _axes(a, at) or []):
        x = x.unsqueeze(ax)
    return x


def _squeeze(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    axes = _axes(a, at)
    return a[0].squeeze() if axes is None else a[0].squeeze(tuple(axes))


def _reduce(name: str) -> Callable[[Graph, list[Any], dict[str, Any]], Any]:
    def op(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
        axes = _axes(a, at)
        keep = bool(at.get("keepdims", 1))
        if axes is None or not axes:
            axes = list(range(a[0].dim()))
        return getattr(a[0], name)(dim=tuple(axes), keepdim=keep)
    return op


def _reduce_l2(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    axes = _axes(a, at) or list(range(a[0].dim()))
    return g.torch.linalg.vector_norm(a[0], dim=tuple(axes), keepdim=bool(at.get("keepdims", 1)))


def _gather(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
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


def _shape(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    dims = list(a[0].shape)[int(at.get("start", 0)):at.get("end")]
    return g.torch.tensor(dims, dtype=g.torch.int64)


def _cast(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    to = ONNX_DTYPES.get(int(at["to"]))
    if to is None:
        raise RuntimeLoadError(f"torch runtime: Cast to ONNX type {at['to']} is not supported")
    dtype = g.float_dtype if to in ("float32", "float16") else getattr(g.torch, to)
    return a[0].to(dtype)


def _concat(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    parts = [t for t in a if t is not None]
    dev = next((t.device for t in parts if t.device.type != "cpu"), parts[0].device)
    return g.torch.cat([t.to(dev) for t in parts], dim=int(at["axis"]))


def _slice(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
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


def _expand(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    shape = _ints(a[1])
    x = a[0]
    nd = max(x.dim(), len(shape))
    xs = [1] * (nd - x.dim()) + list(x.shape)
    ts = [1] * (nd - len(shape)) + shape
    target = [max(p, q) if 1 in (p, q) else p for p, q in zip(xs, ts, strict=True)]
    return x.reshape(xs).expand(target)


def _const_of_shape(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    from onnx import numpy_helper

    value = numpy_helper.to_array(at["value"]) if "value" in at else np.zeros(1, np.float32)
    dtype = g.float_dtype if value.dtype.kind == "f" else getattr(g.torch, value.dtype.name)
    shape = _ints(a[0])
    device = "cpu" if value.dtype.kind in "iub" and math.prod(shape) <= SMALL_INT else g.device
    return g.torch.full(shape, value.reshape(-1)[0].item(), dtype=dtype, device=device)


def _where(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    c, x, y = a
    dev = next((t.device for t in (c, x, y) if t.device.type != "cpu"), c.device)
    return g.torch.where(c.to(dev), x.to(dev), y.to(dev))


def _layer_norm(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    axis = int(at.get("axis", -1)) % a[0].dim()
    shape = tuple(a[0].shape[axis:])
    bias = a[2] if len(a) > 2 else None
    return g.torch.nn.functional.layer_norm(a[0], shape, a[1], bias, float(at.get("epsilon", 1e-5)))


def _softmax(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    return g.torch.softmax(a[0], dim=int(at.get("axis", -1)))


def _clip(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    lo = a[1].item() if len(a) > 1 and a[1] is not None else None
    hi = a[2].item() if len(a) > 2 and a[2] is not None else None
    return a[0].clamp(lo, hi)


def _range(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
    start, limit, delta = (t.item() for t in a)
    return g.torch.arange(start, limit, delta, dtype=a[0].dtype, device=a[0].device)


def _pow(g: Graph, a: list[Any], at: dict[str, Any]) -> Any:
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


OPS: dict[str, Callable[[Graph, list[Any], dict[str, Any]], Any]] = {
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
SUPPORTED_OPS: frozenset[str] = frozenset({*OPS, "Constant"})
