"""Check an uploaded ONNX model before anything else reads it: a tenant's model is hostile input.

``check_model(path, limits)`` refuses, with ``ModelRejected`` whose ``reason`` is a stable word and whose
message names the node, tensor or number at fault:

    reason            refused because
    too_large         the file is over ``max_file_bytes`` (checked before a byte is parsed)
    unreadable        the file cannot be opened or read
    bad_protobuf      the bytes do not decode as an ONNX ModelProto (truncated, garbage, nested too deep)
    not_a_model       no graph, no IR version, no default-domain opset
    ir_version        IR version outside ``ir_versions``
    opset             default-domain opset outside ``opsets``
    custom_domain     a node in a domain other than ONNX's (custom ops, ai.onnx.ml, com.microsoft, ...)
    functions         model-local functions (their bodies would be ops nobody checked)
    too_many_nodes    more nodes than ``max_nodes``, subgraphs included
    subgraph          a node holds a subgraph nested deeper than ``max_subgraph_depth`` (0: none at all)
    op_not_allowed    an op outside ``ALLOWED_OPS``
    external_data     a tensor whose data lives in another file (an upload is one file)
    initializers      more initializers than ``max_initializers``, or a sparse initializer
    initializer_bytes declared tensor bytes over ``max_initializer_bytes``, or data that disagrees with its
                      declared shape (read from dims and data type: nothing is materialized)
    tensor_dtype      a tensor of a data type nothing here computes with (strings, 4-bit, unknown)
    graph             a cycle, an input nothing produces, a name produced twice, an empty graph
    io_dtype, io_rank a graph input or output of a type or rank a serving site cannot take
    checker           ``onnx.checker.check_model(full_check=True)`` refused it (run last, on a bounded model)

Order matters: cheap checks that bound the work (size, counts, bytes) run before the costly ones (the full
checker runs shape inference), so a hostile file costs at most one bounded parse. Every model the project
ships or tests with passes with the default limits (``tests/unit/test_model_check.py``).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import AttributeProto, TensorProto

from mesh.errors import MeshError, ModelRejected
from variant_store.sandbox import SandboxLimits, run_sandboxed_async

__all__ = ["ALLOWED_OPS", "ModelLimits", "ModelSummary", "check_model", "check_model_bytes", "check_upload"]

_MiB = 1 << 20

# Standard ONNX ops (default domain) that ONNX Runtime's CPU provider runs and the generators (ORT's
# quantizers, the FP16 converter) handle as plain tensor math. Left out on purpose: control flow (If,
# Loop, Scan: subgraphs the quantizers do not see into), sequences and optionals (not tensors a caller
# sends), strings and text ops, random generators (a variant's accuracy must be reproducible), image
# decoding, training losses, and ops newer than ONNX Runtime's kernels (Attention, RotaryEmbedding, ...).
ALLOWED_OPS: frozenset[str] = frozenset({
    # element-wise arithmetic and math
    "Abs", "Add", "Sub", "Mul", "Div", "Mod", "Pow", "Neg", "Reciprocal", "Sqrt", "Exp", "Log", "Erf",
    "Ceil", "Floor", "Round", "Sign", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Tanh",
    "Asinh", "Acosh", "Atanh", "Max", "Min", "Mean", "Sum", "Clip", "IsNaN", "IsInf", "Where",
    # comparison and logic
    "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Xor", "Not",
    # activations
    "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "Gelu", "Sigmoid", "HardSigmoid", "HardSwish",
    "Softplus", "Softsign", "Mish", "ThresholdedRelu", "Shrink", "Softmax", "LogSoftmax", "Hardmax",
    # dense, convolution, pooling, normalization
    "Gemm", "MatMul", "Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool",
    "GlobalMaxPool", "LpPool", "GlobalLpPool", "BatchNormalization", "InstanceNormalization",
    "LayerNormalization", "GroupNormalization", "LpNormalization", "LRN", "MeanVarianceNormalization",
    "Dropout", "Einsum",
    # reductions and index ops
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin", "TopK", "CumSum",
    # shape and data movement
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split", "Slice", "Gather",
    "GatherElements", "GatherND", "ScatterElements", "ScatterND", "Expand", "Tile", "Pad", "Shape", "Size",
    "ConstantOfShape", "Range", "OneHot", "Identity", "Cast", "CastLike", "Constant", "DepthToSpace",
    "SpaceToDepth", "Resize", "Trilu", "NonZero",
    # quantized forms (what the INT8 generators themselves emit, so a pre-quantized upload passes)
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger",
    "QLinearMatMul", "QLinearConv",
})

# Data types a graph input or output may have: what a caller sends as a tensor and a runtime takes.
_IO_DTYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT8,
                        TensorProto.UINT8, TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL})
# Bytes per element of the tensor data types a tensor (initializer, Constant) may have.
_ITEMSIZE: dict[int, int] = {
    TensorProto.FLOAT: 4, TensorProto.UINT8: 1, TensorProto.INT8: 1, TensorProto.UINT16: 2, TensorProto.INT16: 2,
    TensorProto.INT32: 4, TensorProto.INT64: 8, TensorProto.BOOL: 1, TensorProto.FLOAT16: 2,
    TensorProto.DOUBLE: 8, TensorProto.UINT32: 4, TensorProto.UINT64: 8, TensorProto.BFLOAT16: 2,
}
_DEFAULT_DOMAINS = ("", "ai.onnx")
_GRAPH_ATTRS = (AttributeProto.GRAPH, AttributeProto.GRAPHS)


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What an uploaded model may be. The defaults fit the largest model the project ships (the MiniLM-L6
    text encoder: 91 MB, 223 nodes, 145 initializers, opset 17, IR 8) with room to spare."""

    max_file_bytes: int = 256 * _MiB
    max_initializer_bytes: int = 256 * _MiB   # declared (dims x element size), Constant nodes' tensors too
    max_initializers: int = 10_000
    max_nodes: int = 10_000                   # every graph, subgraphs included
    max_subgraph_depth: int = 0               # 0: no If/Loop/Scan bodies at all (see ALLOWED_OPS)
    opsets: tuple[int, int] = (7, 21)         # default-domain opset, inclusive (ONNX Runtime runs these)
    ir_versions: tuple[int, int] = (3, 14)    # inclusive; ONNX Runtime 1.32 loads IR 14 (onnx 1.23's default)
    max_io_rank: int = 6
    allowed_ops: frozenset[str] = field(default=ALLOWED_OPS)


@dataclass(frozen=True, slots=True)
class ModelSummary:
    """What the check learned: enough for a registration reply or a log line."""

    file_bytes: int
    ir_version: int
    opset: int
    nodes: int
    initializers: int
    initializer_bytes: int
    ops: tuple[str, ...]                                         # distinct op types, sorted
    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]          # (name, dtype, shape; -1 = symbolic)
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]


def _no(reason: str, message: str, **details: object) -> ModelRejected:
    return ModelRejected(message, reason=reason, **details)


def check_model(path: Path | str, limits: ModelLimits | None = None) -> ModelSummary:
    """Refuse ``path`` (``ModelRejected``) unless it is a self-contained ONNX model within ``limits``."""
    lim = limits or ModelLimits()
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > lim.max_file_bytes:
                raise _no("too_large", f"{path.name}: {size} bytes, over the limit of {lim.max_file_bytes}",
                          file_bytes=size)
            data = f.read(lim.max_file_bytes + 1)  # a file that grows while read is still bounded
    except OSError as exc:
        raise _no("unreadable", f"{path.name}: cannot read the model: {exc}") from exc
    return check_model_bytes(data, lim, name=path.name)


async def check_upload(path: Path | str, limits: ModelLimits | None = None, *,
                       sandbox: SandboxLimits | None = None) -> ModelSummary:
    """``check_model`` in a sandboxed child (``variant_store.sandbox``): the parse and the checker's shape
    inference are C++ run on the tenant's bytes, and a crash or a runaway there must cost the upload, not the
    store. Any failure of the child is a refusal (``ModelRejected``, reason ``checker``)."""
    path = Path(path)
    try:
        summary: ModelSummary = await run_sandboxed_async(
            check_model, (path, limits), limits=sandbox or SandboxLimits(cpu_seconds=120, wall_seconds=180),
            label=f"checking {path.name}", result_classes={f"{__name__}.ModelSummary"})
    except ModelRejected:
        raise
    except MeshError as exc:
        raise ModelRejected(f"{path.name}: checking the model failed: {exc.message}", reason="checker",
                            limit=exc.details.get("limit")) from exc
    return summary


def check_model_bytes(data: bytes, limits: ModelLimits | None = None, *, name: str = "model") -> ModelSummary:
    """``check_model`` for bytes already in memory (an upload's body)."""
    lim = limits or ModelLimits()
    if len(data) > lim.max_file_bytes:
        raise _no("too_large", f"{name}: {len(data)} bytes, over the limit of {lim.max_file_bytes}",
                  file_bytes=len(data))
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # DecodeError, RecursionError, ValueError...: all mean the bytes are not a model
        raise _no("bad_protobuf", f"{name}: not a readable ONNX model (truncated or corrupt protobuf): "
                  f"{type(exc).__name__}: {exc}") from exc
    opset = _check_header(model, lim, name)
    nodes, inits, init_bytes, ops = _check_graphs(model, lim, name)
    inputs = _check_io(model.graph, lim, name, "input")
    outputs = _check_io(model.graph, lim, name, "output")
    order = _check_topology(model.graph, name)
    if order != sorted(order):
        # acyclic but listed out of order (ORT's FP16 converter writes such graphs; ONNX Runtime sorts them):
        # the checker insists on order, so it checks the sorted graph
        nodes_sorted = [onnx.NodeProto.FromString(model.graph.node[i].SerializeToString()) for i in order]
        del model.graph.node[:]
        model.graph.node.extend(nodes_sorted)
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # ValidationError, InferenceError, and whatever else the C++ side throws
        raise _no("checker", f"{name}: onnx.checker refused it: {str(exc).strip()[:500]}") from exc
    return ModelSummary(file_bytes=len(data), ir_version=model.ir_version, opset=opset, nodes=nodes,
                        initializers=inits, initializer_bytes=init_bytes, ops=tuple(sorted(ops)),
                        inputs=inputs, outputs=outputs)


def _check_header(model: onnx.ModelProto, lim: ModelLimits, name: str) -> int:
    if not model.HasField("graph") or model.ir_version == 0:
        raise _no("not_a_model", f"{name}: not an ONNX model (no graph or no IR version)")
    lo, hi = lim.ir_versions
    if not lo <= model.ir_version <= hi:
        raise _no("ir_version", f"{name}: IR version {model.ir_version} is outside the supported {lo}..{hi}")
    # An import of another domain is harmless by itself (ORT's static quantizer adds ai.onnx.ml to every model
    # it writes): a node that uses one is what gets refused, in _check_graphs.
    opset = next((imp.version for imp in model.opset_import if imp.domain in _DEFAULT_DOMAINS), None)
    if opset is None:
        raise _no("not_a_model", f"{name}: no opset import for the default ONNX domain")
    lo, hi = lim.opsets
    if not lo <= opset <= hi:
        raise _no("opset", f"{name}: opset {opset} is outside the supported {lo}..{hi}", opset=opset)
    if len(model.functions):
        raise _no("functions", f"{name}: declares {len(model.functions)} model-local function(s) "
                  f"({model.functions[0].name!r}, ...): not accepted")
    if len(model.training_info):
        raise _no("functions", f"{name}: carries training info: not accepted")
    return opset


def _walk(graph: onnx.GraphProto) -> Iterator[tuple[onnx.GraphProto, int]]:
    """Every graph with its nesting depth (main graph 0), without recursion: a hostile nesting cannot
    overflow the stack."""
    todo: deque[tuple[onnx.GraphProto, int]] = deque([(graph, 0)])
    while todo:
        g, depth = todo.popleft()
        yield g, depth
        for node in g.node:
            for attr in node.attribute:
                if attr.type == AttributeProto.GRAPH:
                    todo.append((attr.g, depth + 1))
                elif attr.type == AttributeProto.GRAPHS:
                    todo.extend((sub, depth + 1) for sub in attr.graphs)


def _check_graphs(model: onnx.ModelProto, lim: ModelLimits, name: str) -> tuple[int, int, int, set[str]]:
    nodes = inits = total = 0
    ops: set[str] = set()
    for g, depth in _walk(model.graph):
        nodes += len(g.node)
        if nodes > lim.max_nodes:
            raise _no("too_many_nodes", f"{name}: more than {lim.max_nodes} nodes", limit=lim.max_nodes)
        if len(g.sparse_initializer):
            raise _no("initializers", f"{name}: sparse initializers are not accepted")
        inits += len(g.initializer)
        if inits > lim.max_initializers:
            raise _no("initializers", f"{name}: more than {lim.max_initializers} initializers")
        tensors = [(t, f"initializer {t.name!r}") for t in g.initializer]
        for i, node in enumerate(g.node):
            label = f"node {node.name or '#' + str(i)!r} ({node.op_type})"
            if node.domain not in _DEFAULT_DOMAINS:
                raise _no("custom_domain", f"{name}: {label} is in op domain {node.domain!r}: only standard "
                          "ONNX ops are accepted (no custom ops)", domain=node.domain)
            if depth >= lim.max_subgraph_depth and any(a.type in _GRAPH_ATTRS for a in node.attribute):
                raise _no("subgraph", f"{name}: {label} holds a subgraph at nesting depth {depth + 1}, over the "
                          f"limit of {lim.max_subgraph_depth} (If/Loop/Scan bodies)", depth=depth + 1)
            if node.op_type not in lim.allowed_ops:
                raise _no("op_not_allowed", f"{name}: {label}: op {node.op_type!r} is not in the allow-list",
                          op=node.op_type)
            for attr in node.attribute:
                if attr.type == AttributeProto.TENSOR:
                    tensors.append((attr.t, f"{label} attribute {attr.name!r}"))
                elif attr.type == AttributeProto.TENSORS:
                    tensors.extend((t, f"{label} attribute {attr.name!r}") for t in attr.tensors)
                elif attr.type in (AttributeProto.SPARSE_TENSOR, AttributeProto.SPARSE_TENSORS):
                    raise _no("initializers", f"{name}: {label}: sparse tensors are not accepted")
            ops.add(node.op_type)
        for t, where in tensors:
            total += _tensor_bytes(t, where, name)
            if total > lim.max_initializer_bytes:
                raise _no("initializer_bytes", f"{name}: {where} brings the declared tensor bytes to {total}, "
                          f"over the limit of {lim.max_initializer_bytes}", declared_bytes=total)
            _check_tensor_data(t, where, name)
    return nodes, inits, total, ops


def _tensor_bytes(t: TensorProto, where: str, name: str) -> int:
    """Bytes a tensor declares (dims x element size): Python ints, so no overflow and no allocation."""
    if t.data_location == TensorProto.EXTERNAL or len(t.external_data):
        loc = next((e.value for e in t.external_data if e.key == "location"), "")
        outside = os.path.isabs(loc) or ".." in Path(loc).parts
        why = "points outside the upload" if outside else "lives in another file"
        raise _no("external_data", f"{name}: {where}: its data {why} ({loc!r}): external data is not "
                  "accepted, an upload is one self-contained file", location=loc)
    size = _ITEMSIZE.get(t.data_type)
    if size is None:
        dtype = TensorProto.DataType.Name(t.data_type) if t.data_type in TensorProto.DataType.values() else \
            str(t.data_type)
        raise _no("tensor_dtype", f"{name}: {where} has data type {dtype}, not accepted")
    if any(d < 0 for d in t.dims):
        raise _no("initializer_bytes", f"{name}: {where} declares a negative dimension {list(t.dims)}")
    return math.prod(t.dims) * size


def _check_tensor_data(t: TensorProto, where: str, name: str) -> None:
    declared = math.prod(t.dims) * _ITEMSIZE[t.data_type]
    if t.HasField("raw_data"):
        if len(t.raw_data) != declared:
            raise _no("initializer_bytes", f"{name}: {where} carries {len(t.raw_data)} bytes of data but "
                      f"declares {declared} (dims {list(t.dims)})")
        return
    typed = (len(t.float_data) + len(t.int32_data) + len(t.int64_data) + len(t.double_data)
             + len(t.uint64_data))
    if declared and not typed:
        raise _no("initializer_bytes", f"{name}: {where} declares {declared} bytes (dims {list(t.dims)}) "
                  "but carries no data")


def _check_io(graph: onnx.GraphProto, lim: ModelLimits, name: str,
              kind: str) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    inits = {t.name for t in graph.initializer}
    values = [v for v in (graph.input if kind == "input" else graph.output) if v.name not in inits]
    if not values:
        raise _no("graph", f"{name}: the graph has no {kind}s")
    out = []
    for v in values:
        if v.type.WhichOneof("value") != "tensor_type":
            raise _no("io_dtype", f"{name}: {kind} {v.name!r} is not a tensor "
                      f"({v.type.WhichOneof('value') or 'no type'})")
        tt = v.type.tensor_type
        if tt.elem_type not in _IO_DTYPES:
            dtype = TensorProto.DataType.Name(tt.elem_type) if tt.elem_type in TensorProto.DataType.values() \
                else str(tt.elem_type)
            raise _no("io_dtype", f"{name}: {kind} {v.name!r} has data type {dtype}: accepted are "
                      f"{sorted(TensorProto.DataType.Name(d) for d in _IO_DTYPES)}", dtype=dtype)
        rank = len(tt.shape.dim)
        if not tt.HasField("shape") or not 1 <= rank <= lim.max_io_rank:
            raise _no("io_rank", f"{name}: {kind} {v.name!r} has rank {rank if tt.HasField('shape') else '?'}: "
                      f"a batch dimension and at most {lim.max_io_rank} dimensions are needed")
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
        dtype_name = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name
        out.append((v.name, dtype_name, shape))
    return tuple(out)


def _check_topology(graph: onnx.GraphProto, name: str) -> list[int]:
    """Every node input is a graph input, an initializer or some node's output, each name is produced once,
    and the nodes form no cycle (Kahn's algorithm: whatever cannot be ordered is on or behind a cycle).
    Returns the node indexes in an order that runs. Subgraph bodies (allowed only when ``max_subgraph_depth``
    > 0) are left to the checker: they may read names of the enclosing scope."""
    if not len(graph.node):
        raise _no("graph", f"{name}: the graph has no nodes")
    given = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if out and (out in producer or out in given):
                raise _no("graph", f"{name}: value {out!r} is produced twice (node {node.name or i!r})")
            if out:
                producer[out] = i
    waiting = [0] * len(graph.node)
    users: dict[int, list[int]] = {}
    for i, node in enumerate(graph.node):
        for inp in {x for x in node.input if x}:
            if inp in given:
                continue
            if inp not in producer:
                raise _no("graph", f"{name}: node {node.name or i!r} ({node.op_type}) reads {inp!r}, which no "
                          "node, input or initializer produces")
            waiting[i] += 1
            users.setdefault(producer[inp], []).append(i)
    ready = deque(i for i, w in enumerate(waiting) if w == 0)
    order: list[int] = []
    while ready:
        i = ready.popleft()
        order.append(i)
        for j in users.get(i, ()):
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if len(order) < len(graph.node):
        stuck = [graph.node[i].name or str(i) for i, w in enumerate(waiting) if w > 0][:5]
        raise _no("graph", f"{name}: the graph has a cycle (nodes that can never run: {stuck})")
    for v in graph.output:
        if v.name not in given and v.name not in producer:
            raise _no("graph", f"{name}: output {v.name!r} is produced by no node")
    return order
