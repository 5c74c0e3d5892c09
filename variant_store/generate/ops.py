"""Op-set checks: which generators can take which ONNX graph, decided before any work is done.

A generator that cannot handle an op says so by naming the op and the node (``unsupported op
AveragePool at node 'pool1'``), so a model owner learns why a variant is missing from the catalog.
"""

from __future__ import annotations

from collections import Counter

import onnx

__all__ = [
    "CONV_OPS",
    "TFLITE_WRITER_OPS",
    "first_unsupported",
    "has_conv",
    "op_histogram",
    "unsupported_nodes",
]

# What the TFLite INT8 writer lowers: dense and 2-D conv layers with fused ReLU, max-pooling, and
# shape glue (the image reshape of the input, the flatten before the dense head).
TFLITE_WRITER_OPS: frozenset[str] = frozenset(
    {"Gemm", "MatMul", "Add", "Relu", "Reshape", "Flatten", "Identity", "Constant", "Conv", "MaxPool"})

CONV_OPS: frozenset[str] = frozenset({"Conv", "ConvTranspose", "ConvInteger", "QLinearConv"})


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"#{index}:{node.output[0] if node.output else node.op_type}"


def unsupported_nodes(model: onnx.ModelProto, supported: frozenset[str]) -> list[tuple[str, str]]:
    """(op_type, node name) of every node of the main graph outside ``supported``, in graph order."""
    out: list[tuple[str, str]] = []
    for i, node in enumerate(model.graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in supported:
            op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            out.append((op, _node_label(node, i)))
    return out


def first_unsupported(model: onnx.ModelProto, supported: frozenset[str]) -> tuple[str, str] | None:
    bad = unsupported_nodes(model, supported)
    return bad[0] if bad else None


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    return dict(Counter(n.op_type for n in model.graph.node))


def has_conv(model: onnx.ModelProto) -> bool:
    """Convolutional graphs want static QDQ INT8: dynamic INT8 on convs measured 2-5x slower."""
    return any(n.op_type in CONV_OPS for n in model.graph.node)
