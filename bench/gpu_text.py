"""The text family on a GPU for ``gpu_profile``: the six-layer FP32 MiniLM encoder that the mesh serves
(``variant_store.families.text``, its tokenizer inside the file), with both tenants' heads.

Each runtime configuration gets the encoder's p50 per call at batch 1-64 (text in, embedding out:
tokenizing on the host included, as served) and the accuracy it keeps: cosine of its embeddings to ONNX
Runtime's on the CPU, and both heads' top-1 on the 848 held-out descriptions, heads run by ONNX Runtime
on the CPU over the configuration's embeddings (the heads are one ``MatMul + Add``).

The family is found in ``TIERMESH_TEXT_FAMILY_DIR``, else in the local cache when it was built there
(``variant_store.build_text``); nothing is built on the GPU host. ``python -m bench.gpu_text pack OUT``
writes a copy that travels to a lent GPU machine (64 MiB per call): the encoder's word-embedding rows of
tokens that the held-out descriptions never use are zeroed and the file gzipped; the heads, the validation
sets and a manifest of just these files (the packed encoder's own digest) go beside it, so the directory,
unpacked (``python -m bench.gpu_text unpack DIR``), is a text family ``variant_store.build_text`` verifies
(``TIERMESH_TEXT_FAMILY_DIR``). A Gather reads only the
rows of the tokens it is given, so on those descriptions its outputs are bit-identical to the full
encoder's (checked when packing).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ENCODER", "HEADS", "find_text_family", "pack_text_family", "profile_text", "unpacked_family"]

ENCODER = "minilm-l6.onnx"
HEADS = {"text-topic": "topic-minilm-l6.onnx", "text-group": "group-minilm-l6.onnx"}


def _texts(x: np.ndarray) -> np.ndarray:
    return np.array([t if isinstance(t, bytes) else str(t).encode() for t in x], dtype=object)


def find_text_family() -> Path | None:
    """A directory holding the encoder (plain or ``.gz``), both heads and ``manifest.json``, or None."""
    env = os.environ.get("TIERMESH_TEXT_FAMILY_DIR")
    if env:
        return Path(env)
    try:
        from variant_store.build_text import default_cache_dir

        roots = sorted(default_cache_dir().glob("text-family-*"))
    except Exception:  # no cache, or the family's build inputs absent on this host
        return None
    return next((r for r in roots if (r / ENCODER).is_file() and (r / "manifest.json").is_file()), None)


@contextmanager
def unpacked_family(d: Path) -> Iterator[Path]:
    if (d / ENCODER).is_file():
        yield d
        return
    tmp = Path(tempfile.mkdtemp(prefix="tiermesh-text-"))
    try:
        with gzip.open(d / f"{ENCODER}.gz", "rb") as src, open(tmp / ENCODER, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        for f in d.iterdir():
            if f.is_file() and f.name != f"{ENCODER}.gz":
                shutil.copy(f, tmp / f.name)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _embed(rt: Any, texts: np.ndarray, chunk: int = 64) -> np.ndarray:
    return np.concatenate([rt.infer_sync({"text": texts[i:i + chunk]})["embedding"]
                           for i in range(0, len(texts), chunk)])


def _top1(head: Path, emb: np.ndarray, y: np.ndarray) -> float:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(head), providers=["CPUExecutionProvider"])
    logits = np.asarray(sess.run(None, {"embedding": emb.astype(np.float32)})[0])
    return float(np.mean(logits.argmax(1) == y))


def _time(rt: Any, texts: np.ndarray, repeats: int, budget_s: float) -> tuple[float, float]:
    from variant_store.profiler import timed_runs

    times = timed_runs(rt, "text", texts, repeats, budget_s)
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


def profile_text(family: Path, configs: tuple[tuple[str, str, dict[str, Any]], ...], batches: tuple[int, ...],
                 *, repeats: int, budget_s: float) -> tuple[list[dict[str, Any]], dict[str, list[float]],
                                                         dict[str, Any]]:
    """Rows, p50 curves by configuration and profile documents (as ``gpu_profile`` writes them)."""
    from variant_store.families.text_corpus import load_corpus
    from variant_store.hardware import hardware_class_for
    from variant_store.runtimes import open_runtime

    x, y = load_corpus().holdout()
    texts = _texts(x)
    rows: list[dict[str, Any]] = []
    curves: dict[str, list[float]] = {}
    profiles: dict[str, Any] = {}
    with unpacked_family(family) as d:
        manifest = json.loads((d / "manifest.json").read_text())
        recorded = {m["task"]: m["accuracy"] for m in manifest["models"] if m.get("backbone") == ENCODER}
        labels = {"text-topic": y, "text-group": _group(y)}
        ref_rt = open_runtime("onnx", d / ENCODER, intra_op_threads=os.cpu_count() or 1)
        ref_rt.load_sync()
        try:
            ref = _embed(ref_rt, texts)
        finally:
            ref_rt.unload_sync()
        for label, fmt, opts in configs:
            rt = open_runtime(fmt, d / ENCODER, **opts)
            rt.load_sync()
            try:
                emb = _embed(rt, texts)
                lat = {b: _time(rt, texts[:b], repeats, budget_s) for b in batches}
                failures = len(getattr(rt, "graph_failures", {}))
                load_ms, dev, hw = rt.load_ms, rt.device_memory_bytes(), hardware_class_for(rt.providers_in_use)
                providers = list(rt.providers_in_use)
            finally:
                rt.unload_sync()
            cos = np.sum(emb * ref, axis=1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(ref, axis=1))
            top1 = {task: _top1(d / HEADS[task], emb, labels[task]) for task in HEADS}
            top = max(batches)
            rows.append({"task": "text-embedding", "model": "minilm-l6", "config": label, "hardware_class": hw,
                         "cosine_min_vs_ort_cpu": round(float(cos.min()), 7),
                         **{f"{task}_top1": round(v, 4) for task, v in top1.items()},
                         **{f"{task}_top1_recorded": round(recorded[task], 4) for task in HEADS},
                         "graph_capture_failures": failures, "load_ms": round(load_ms, 1),
                         "device_mem_mib": round(dev / 2**20, 2),
                         **{f"p50_ms_b{b}": round(lat[b][0], 4) for b in (1, 8, 64) if b in lat},
                         "items_per_s_b64": round(top / (lat[top][0] / 1000.0))})
            curves[label] = [lat[b][0] for b in batches]
            profiles[f"minilm-l6.{label}"] = {
                "runtime": fmt, "options": opts, "accuracy": top1, "profile": {
                    "hardware_class": hw, "load_ms": load_ms, "providers": providers, "peak_memory_bytes": dev,
                    "latency": {str(b): {"p50_ms": p50, "p99_ms": p99} for b, (p50, p99) in lat.items()}}}
            print(f"  minilm-l6  {label:32s} {rows[-1]}", flush=True)
    return rows, curves, profiles


def _group(y: np.ndarray) -> np.ndarray:
    from variant_store.families.text_corpus import Corpus

    return np.asarray(Corpus.group_of(y))


def pack_text_family(src: Path, out: Path) -> Path:
    """Zero the encoder's embedding rows no held-out description uses, gzip it; copy heads and manifest."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from variant_store.families.text_corpus import load_corpus
    from variant_store.runtimes.text import text_front

    model = onnx.load(str(src / ENCODER))
    front = text_front({p.key: p.value for p in model.metadata_props}, ("input_ids", "attention_mask"))
    if front is None:
        raise RuntimeError(f"{src / ENCODER} carries no tokenizer")
    texts = _texts(load_corpus().holdout()[0])
    used = np.unique(np.concatenate([front.encode(texts[i:i + 64])["input_ids"].ravel()
                                     for i in range(0, len(texts), 64)]))
    init = next(i for i in model.graph.initializer if i.name == "word_embeddings")
    table = numpy_helper.to_array(init).copy()
    keep = np.zeros(len(table), bool)
    keep[used] = True
    table[~keep] = 0.0
    init.CopyFrom(numpy_helper.from_array(table, init.name))
    out.mkdir(parents=True, exist_ok=True)
    packed = out / ENCODER
    packed.write_bytes(model.SerializeToString())

    def run(p: Path) -> np.ndarray:
        sess = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
        return np.concatenate([np.asarray(sess.run(None, front.encode(texts[i:i + 64]))[0])
                               for i in range(0, len(texts), 64)])

    if not np.array_equal(run(src / ENCODER), run(packed)):
        raise RuntimeError("the packed encoder differs from the full one on the held-out descriptions")
    manifest = json.loads((src / "manifest.json").read_text())
    keep_models = [m for m in manifest["models"] if m["file"] == ENCODER or m.get("backbone") == ENCODER]
    for m in keep_models:
        if m["file"] == ENCODER:  # the packed encoder is its own file: its digest and size
            data = packed.read_bytes()
            m["sha256"], m["size_bytes"] = hashlib.sha256(data).hexdigest(), len(data)
            m["packed"] = "word-embedding rows of tokens no held-out description uses are zeroed"
    manifest["models"] = keep_models
    for name in [*HEADS.values(), *(f["file"] for f in manifest["dataset"]["files"].values())]:
        shutil.copy(src / name, out / name)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    with gzip.open(out / f"{ENCODER}.gz", "wb", compresslevel=6) as fh:
        fh.write(packed.read_bytes())
    packed.unlink()
    print(f"kept {keep.sum()} of {len(table)} embedding rows; outputs identical on {len(texts)} descriptions "
          f"-> {out} ({(out / f'{ENCODER}.gz').stat().st_size / 2**20:.1f} MiB)")
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["unpack"] and len(args) == 2:
        d = Path(args[1])
        with gzip.open(d / f"{ENCODER}.gz", "rb") as src_fh, open(d / ENCODER, "wb") as dst_fh:
            shutil.copyfileobj(src_fh, dst_fh, 1 << 20)
        return 0
    if args[:1] != ["pack"] or len(args) != 2:
        print("usage: python -m bench.gpu_text pack OUT | unpack DIR", file=sys.stderr)
        return 2
    src = find_text_family()
    if src is None or not (src / ENCODER).is_file():
        print("no built text family here (`make demo` or the tests build it into ~/.cache/tiermesh)",
              file=sys.stderr)
        return 1
    pack_text_family(src, Path(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
