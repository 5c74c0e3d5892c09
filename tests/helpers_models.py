"""Small REAL models for tests that must not need torch.

``trained_mlp_onnx`` trains scikit-learn's ``MLPClassifier`` on the bundled digits set and writes
its learned weights to ONNX by hand (Gemm + Relu, input ``x`` (N, 64) float32 -> ``logits``
(N, 10)), so accuracy numbers measured on it are real. ``conv_onnx`` builds a small convolutional
graph with fixed random weights: only for op-set / converter tests, never for accuracy claims.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["DigitsSplit", "conv_onnx", "digits_split", "mlp_onnx_bytes", "trained_mlp_onnx"]

OPSET = 17


@dataclass(frozen=True)
class DigitsSplit:
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray


@functools.lru_cache(maxsize=1)
def digits_split(seed: int = 0) -> DigitsSplit:
    """sklearn digits scaled to [0, 1] (pixels / 16), a fixed 75 / 25 stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    ds = load_digits()
    x = (ds.data / 16.0).astype(np.float32)
    y = ds.target.astype(np.int64)
    xt, xv, yt, yv = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return DigitsSplit(xt, yt, xv, yv)


@functools.lru_cache(maxsize=4)
def mlp_onnx_bytes(hidden: tuple[int, ...] = (64,), seed: int = 0) -> bytes:
    """Train an MLP on the digits training split and return it as serialized ONNX (cached per process)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    split = digits_split()
    clf = MLPClassifier(hidden_layer_sizes=hidden, activation="relu", max_iter=300, random_state=seed)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(split.x_train, split.y_train)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    prev = "x"
    n_layers = len(clf.coefs_)
    for i, (w, b) in enumerate(zip(clf.coefs_, clf.intercepts_, strict=True)):
        # sklearn stores W as (in, out); Gemm with transB=1 wants (out, in) like torch's Linear export.
        wn, bn = f"fc{i}.weight", f"fc{i}.bias"
        inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T, dtype=np.float32), wn))
        inits.append(numpy_helper.from_array(b.astype(np.float32), bn))
        last = i == n_layers - 1
        out = "logits" if last else f"fc{i}_out"
        nodes.append(helper.make_node("Gemm", [prev, wn, bn], [out], name=f"fc{i}", transB=1))
        if not last:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i}_out"], name=f"relu{i}"))
            prev = f"relu{i}_out"
    return _digits_graph(nodes, inits, "digits_mlp")


def trained_mlp_onnx(path: Path, hidden: tuple[int, ...] = (64,)) -> Path:
    path.write_bytes(mlp_onnx_bytes(hidden))
    return path


def conv_onnx(path: Path, seed: int = 0) -> Path:
    """x (N, 64) -> Reshape (N, 1, 8, 8) -> Conv 3x3 -> Relu -> MaxPool 2x2 -> Flatten -> Gemm -> logits."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(np.array([-1, 1, 8, 8], dtype=np.int64), "shape"),
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 1, 3, 3)).astype(np.float32), "conv1.weight"),
        numpy_helper.from_array(rng.normal(0, 0.1, (8,)).astype(np.float32), "conv1.bias"),
        numpy_helper.from_array(rng.normal(0, 0.1, (10, 8 * 4 * 4)).astype(np.float32), "fc.weight"),
        numpy_helper.from_array(rng.normal(0, 0.1, (10,)).astype(np.float32), "fc.bias"),
    ]
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["img"], name="reshape"),
        helper.make_node("Conv", ["img", "conv1.weight", "conv1.bias"], ["c1"], name="conv1",
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p1"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1),
    ]
    path.write_bytes(_digits_graph(nodes, inits, "digits_conv"))
    return path


def _digits_graph(nodes: list[Any], inits: list[Any], name: str) -> bytes:
    """A checked model with the digits signature: x (N, 64) float32 -> logits (N, 10)."""
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="tiermesh-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()
