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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mesh.errors import RuntimeLoadError
from mesh.types import TensorSpec
from variant_store.runtimes.onnx_torch_ops import ONNX_DTYPES, OPS, SMALL_INT, SUPPORTED_OPS

__all__ = ["TorchGraph", "graph_specs"]



def _spec(value_info: Any) -> TensorSpec:
    t = value_info.type.tensor_type
    dims = tuple(int(d.dim_value) if d.HasField("dim_value") else -1 for d in t.shape.dim)
    return TensorSpec(value_info.name, ONNX_DTYPES.get(t.elem_type, f"onnx-{t.elem_type}"), dims)


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
            fn = OPS.get(n.op_type)
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
        return t if t.numel() <= SMALL_INT and arr.dtype.kind in "iub" else t.to(self.device)

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
