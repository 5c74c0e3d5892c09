"""A backbone wide enough for sharing to matter, trained for real and cheaply (for ``bench.shared_backbone``).

scikit-learn's MLP (three 2048-wide ReLU layers, 10 epochs, about a minute on 2 cores) on the bundled digits
set; its hidden layers are the backbone (x -> 2048 features), its output layer the digits head, and a
logistic regression on its features the parity head. Exported by hand to ONNX (Gemm + Relu) as the
backbone, each head, and each full model (backbone + head in one graph), cached under
``.tiermesh/bench-models/wide-backbone-<widths>`` with their holdout accuracies in ``models.json``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import CACHE_DIR

__all__ = ["HIDDEN", "build_models"]

HIDDEN = (2048, 2048, 2048)


def _gemm_layers(weights: list[tuple[np.ndarray, np.ndarray]], inp: str, out: str, prefix: str,
                 relu_last: bool) -> tuple[list[Any], list[Any]]:
    from onnx import helper, numpy_helper

    nodes, inits, prev = [], [], inp
    for i, (w, b) in enumerate(weights):
        last = i == len(weights) - 1
        wn, bn, y = f"{prefix}{i}.w", f"{prefix}{i}.b", f"{prefix}{i}.y"
        inits += [numpy_helper.from_array(np.ascontiguousarray(w.T, dtype=np.float32), wn),
                  numpy_helper.from_array(b.astype(np.float32), bn)]
        nodes.append(helper.make_node("Gemm", [prev, wn, bn], [y if (relu_last or not last) else out], transB=1))
        if relu_last or not last:
            nodes.append(helper.make_node("Relu", [y], [out if last else f"{prefix}{i}.r"]))
            prev = f"{prefix}{i}.r"
    return nodes, inits


def _save(path: Path, parts: list[tuple[list[Any], list[Any]]], inp: tuple[str, int], out: tuple[str, int]) -> None:
    import onnx
    from onnx import TensorProto, helper

    nodes = [n for p in parts for n in p[0]]
    inits = [t for p in parts for t in p[1]]
    graph = helper.make_graph(nodes, path.stem,
                              [helper.make_tensor_value_info(inp[0], TensorProto.FLOAT, ["N", inp[1]])],
                              [helper.make_tensor_value_info(out[0], TensorProto.FLOAT, ["N", out[1]])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tiermesh-bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(model.SerializeToString())
    tmp.replace(path)


def build_models(root: Path | None = None) -> dict[str, Any]:
    """Train (once; cached) and export backbone, heads and full models; returns paths and accuracies."""
    root = root or CACHE_DIR / f"wide-backbone-{'x'.join(map(str, HIDDEN))}"
    info_path = root / "models.json"
    if info_path.is_file():
        return dict(json.loads(info_path.read_text()))
    from sklearn.datasets import load_digits
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier

    root.mkdir(parents=True, exist_ok=True)
    ds = load_digits()
    x = (ds.data / 16.0).astype(np.float32)
    xt, xv, yt, yv = train_test_split(x, ds.target, test_size=0.3, random_state=0, stratify=ds.target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = MLPClassifier(HIDDEN, max_iter=10, random_state=0).fit(xt, yt)
    layers = list(zip(clf.coefs_, clf.intercepts_, strict=True))
    trunk, top = layers[:-1], layers[-1:]

    def feats(a: np.ndarray) -> np.ndarray:
        for w, b in trunk:
            a = np.maximum(a @ w + b, 0.0)
        return a

    par = LogisticRegression(max_iter=500).fit(feats(xt), yt % 2)
    parity = [(par.coef_.T, par.intercept_)]
    if par.coef_.shape[0] == 1:  # binary: two logits (-z/2, z/2) so both heads end in a softmax-able pair
        parity = [(np.hstack([-par.coef_.T / 2, par.coef_.T / 2]), np.array([-par.intercept_[0] / 2,
                                                                           par.intercept_[0] / 2]))]
    width = HIDDEN[-1]
    backbone = _gemm_layers(trunk, "x", "features", "bb", relu_last=True)
    heads = {"digits": (_gemm_layers(top, "features", "logits", "hd", False), 10),
             "parity": (_gemm_layers(parity, "features", "logits", "hp", False), 2)}
    _save(root / "backbone.onnx", [backbone], ("x", 64), ("features", width))
    for name, (head, k) in heads.items():
        _save(root / f"head-{name}.onnx", [head], ("features", width), ("logits", k))
        _save(root / f"full-{name}.onnx", [backbone, head], ("x", 64), ("logits", k))
    info = {"root": str(root), "hidden": list(HIDDEN), "params_backbone": int(sum(w.size + b.size for w, b in trunk)),
            "accuracy_digits": round(float(clf.score(xv, yv)), 4),
            "accuracy_parity": round(float(par.score(feats(xv), yv % 2)), 4),
            "backbone_bytes": (root / "backbone.onnx").stat().st_size}
    info_path.write_text(json.dumps(info, indent=1))
    return info
