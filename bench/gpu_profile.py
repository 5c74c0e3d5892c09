"""``gpu_profile``: the digits and text families on a CUDA GPU through the torch-cuda runtime,
FP32 and FP16, CUDA graphs on and off, batch 1-64, beside ONNX Runtime on the same host's CPU.

Only on a host where PyTorch sees a GPU (``python -m bench --only gpu_profile``; it is not in the
default scenario list). Digits go through :func:`variant_store.profiler.profile_variant`, so the
profiles written under ``profiles`` are the catalog's own type, keyed by the hardware class the
profiler derived (``gpu-h100``, ``cpu-x86_64``). MiniLM runs when ``TIERMESH_MINILM_DIR`` (or
``.tiermesh/minilm``) holds ``minilm-l6.fp32.onnx`` and ``tokenizer.json``.

``python -m bench.gpu_profile pack-minilm SRC OUT`` writes a copy of the MiniLM export small enough
to travel to a lent GPU machine (64 MiB per call): word-embedding rows of tokens that the profiling
sentences never use are zeroed and the file gzipped. A Gather reads only the rows of the tokens it
is given, so on those sentences its outputs are bit-identical to the full model's (checked when
packing).
"""

from __future__ import annotations

import asyncio
import gzip
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import MODELS_DIR, REPO_ROOT, Panel, RunContext, plot_panels, target, write_result
from variant_store.hardware import hardware_class_for, torch_cuda_available
from variant_store.meta import LatencyStats
from variant_store.profiler import profile_variant

__all__ = ["pack_minilm", "run_gpu_profile"]

BATCHES = (1, 2, 4, 8, 16, 32, 64)
DIGITS = ("mlp-tiny", "mlp-wide", "cnn-small", "cnn-large")
# (label, runtime format, constructor options)
CONFIGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("torch-cuda fp32 graphs", "torch-cuda", {"precision": "fp32", "cuda_graphs": True}),
    ("torch-cuda fp16 graphs", "torch-cuda", {"precision": "fp16", "cuda_graphs": True}),
    ("torch-cuda fp32 eager", "torch-cuda", {"precision": "fp32", "cuda_graphs": False}),
    ("torch-cuda fp16 eager", "torch-cuda", {"precision": "fp16", "cuda_graphs": False}),
    ("onnxruntime cpu fp32 1 thread", "onnx", {}),
)
PROFILE_SENTENCES = 256


def _device_info() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return {"gpu": torch.cuda.get_device_name(0), "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count, "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "hardware_class": f"gpu-{torch_cuda_available()[1]}"}


def _outputs(fmt: str, path: Path, feeds: dict[str, np.ndarray], opts: dict[str, Any], chunk: int = 64) -> np.ndarray:
    from variant_store.runtimes import open_runtime

    rt = open_runtime(fmt, path, **opts)
    rt.load_sync()
    try:
        n = len(next(iter(feeds.values())))
        name = rt.output_specs[0].name
        return np.concatenate([rt.infer_sync({k: v[i:i + chunk] for k, v in feeds.items()})[name]
                               for i in range(0, n, chunk)])
    finally:
        rt.unload_sync()


def _lat_row(lat: dict[int, LatencyStats]) -> dict[str, Any]:
    row: dict[str, Any] = {f"p50_ms_b{b}": round(lat[b].p50_ms, 4) for b in (1, 8, 64) if b in lat}
    top = max(lat)
    row["items_per_s_b64"] = round(top / (lat[top].p50_ms / 1000.0))
    return row


def _digits(ctx: RunContext, profiles: dict[str, Any],
            curves: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    from variant_store.families.datasets import load_validation_npz

    val = load_validation_npz()
    x, y = val.x_holdout, val.y_holdout
    rows = []
    for model in DIGITS:
        path = MODELS_DIR / f"{model}.onnx"
        ref = _outputs("onnx", path, {"x": x}, {})
        for label, fmt, opts in CONFIGS:
            res = profile_variant(fmt, path, x, y, batch_sizes=BATCHES, repeats=ctx.pick(60, 300),
                                  time_budget_s=0.3 if ctx.quick else 1.5, runtime_options=opts)
            out = _outputs(fmt, path, {"x": x}, opts)
            rows.append({"task": "digit-classification", "model": model, "config": label,
                         "hardware_class": res.hardware_class, "accuracy": round(res.accuracy, 4),
                         "max_abs_diff_vs_ort_cpu": float(np.abs(out - ref).max()),
                         "top1_agree_vs_ort_cpu": round(float(np.mean(out.argmax(1) == ref.argmax(1))), 4),
                         "load_ms": round(res.load_ms, 1), "device_mem_mib": round(res.device_memory_bytes / 2**20, 2),
                         **_lat_row(res.latency)})
            key = f"{model}.{label}"
            profiles[key] = {"runtime": fmt, "options": opts, "accuracy": res.accuracy,
                             "profile": _profile_json(res.to_profile())}
            if model == "cnn-large":
                curves.setdefault("cnn-large", {})[label] = [res.latency[b].p50_ms for b in BATCHES]
            print(f"  {model:10s} {label:32s} {rows[-1]}", flush=True)
    return rows


def _profile_json(prof: Any) -> dict[str, Any]:
    return {"hardware_class": prof.hardware_class, "load_ms": prof.load_ms, "providers": prof.providers,
            "peak_memory_bytes": prof.peak_memory_bytes,
            "latency": {str(b): {"p50_ms": s.p50_ms, "p99_ms": s.p99_ms} for b, s in prof.latency.items()}}


def _minilm_dir() -> Path | None:
    d = Path(os.environ.get("TIERMESH_MINILM_DIR") or REPO_ROOT / ".tiermesh" / "minilm")
    return d if (d / "minilm-l6.fp32.onnx").is_file() and (d / "tokenizer.json").is_file() else None


def _time(rt: Any, feeds: dict[str, np.ndarray], repeats: int, budget_s: float) -> tuple[float, float, int]:
    rt.infer_sync(feeds)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(repeats):
        t0 = time.perf_counter()
        rt.infer_sync(feeds)
        times.append((time.perf_counter() - t0) * 1000.0)
        if time.perf_counter() > deadline:
            break
    return float(np.percentile(times, 50)), float(np.percentile(times, 99)), len(times)


def _text(ctx: RunContext, d: Path, curves: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    from variant_store.families.minilm import cosine_rows, sentences, tokenize
    from variant_store.runtimes import open_runtime

    texts = sentences(PROFILE_SENTENCES)
    feeds = tokenize(texts, d / "tokenizer.json")   # one padded length for every batch size
    path = d / "minilm-l6.fp32.onnx"
    ref = _outputs("onnx", path, feeds, {"intra_op_threads": 4})
    rows = []
    for label, fmt, opts in CONFIGS:
        out = _outputs(fmt, path, feeds, {**opts, "intra_op_threads": 1})
        cos = cosine_rows(out.astype(np.float64), ref.astype(np.float64))
        rt = open_runtime(fmt, path, **opts)
        rt.load_sync()
        lat: dict[int, LatencyStats] = {}
        try:
            for b in BATCHES:
                batch = {k: v[:b] for k, v in feeds.items()}
                p50, p99, _n = _time(rt, batch, ctx.pick(30, 200), 0.5 if ctx.quick else 2.0)
                lat[b] = LatencyStats(p50_ms=p50, p99_ms=p99)
            failures = len(getattr(rt, "graph_failures", {}))
            load_ms, dev, hw = rt.load_ms, rt.device_memory_bytes(), hardware_class_for(rt.providers_in_use)
        finally:
            rt.unload_sync()
        rows.append({"task": "text-embedding", "model": "minilm-l6 (seq len "
                     f"{feeds['input_ids'].shape[1]})", "config": label,
                     "hardware_class": hw,
                     "accuracy": round(float(cos.mean()), 6), "cosine_min_vs_ort_cpu": round(float(cos.min()), 6),
                     "graph_capture_failures": failures, "load_ms": round(load_ms, 1),
                     "device_mem_mib": round(dev / 2**20, 2), **_lat_row(lat)})
        curves.setdefault("minilm", {})[label] = [lat[b].p50_ms for b in BATCHES]
        print(f"  minilm     {label:32s} {rows[-1]}", flush=True)
    return rows


def _measure(ctx: RunContext) -> Path:
    ok, why = torch_cuda_available()
    if not ok:
        raise RuntimeError(f"gpu_profile needs a CUDA GPU for torch: {why}")
    device = _device_info()
    print(f"  device: {device['gpu']} ({device['hardware_class']}), torch {device['torch']}, "
          f"CUDA {device['cuda']}", flush=True)
    profiles: dict[str, Any] = {}
    curves: dict[str, dict[str, list[float]]] = {}
    rows = _digits(ctx, profiles, curves)
    d = _minilm_dir()
    text_note = "MiniLM: not built on this host (set TIERMESH_MINILM_DIR)"
    if d is not None:
        rows += _text(ctx, d, curves)
        text_note = f"MiniLM from {d.name}: {PROFILE_SENTENCES} generated sentences, accuracy = mean cosine vs ORT CPU"
    targets = _targets(rows)
    groups = [str(b) for b in BATCHES]
    panels = [Panel(f"{name}: p50 per call", "ms (log)", groups, series, log_y=True)
              for name, series in curves.items()]
    gpu_b64 = {r["model"]: r["items_per_s_b64"] for r in rows if r["config"] == "torch-cuda fp16 graphs"}
    cpu_b64 = {r["model"]: r["items_per_s_b64"] for r in rows if r["config"].startswith("onnxruntime")}
    models = [m for m in gpu_b64 if m in cpu_b64]
    panels.append(Panel("items/s at batch 64", "items/s (log)", [m.split(" ")[0] for m in models],
                        {"GPU fp16 graphs": [gpu_b64[m] for m in models],
                         "CPU ORT 1 thread": [cpu_b64[m] for m in models]}, log_y=True))
    plot_panels(ctx.results_dir / "gpu_profile.png", f"GPU profile on {device['gpu']} (torch-cuda runtime)", panels)
    return write_result(ctx, "gpu_profile", rows, targets, notes=(
        f"Device: {device['gpu']}, driver {device['driver']}, torch {device['torch']} (CUDA {device['cuda']}). "
        "Latency = one infer_sync call from numpy in to numpy out (host copies and sync included), p50 over "
        f"repeated calls per batch size {list(BATCHES)}. Digits accuracy = top-1 on the 519-image holdout; "
        f"max_abs_diff = logits vs ONNX Runtime CPU. CPU rows ran on the same host, 1 intra-op thread. {text_note}."),
        extra={"device": device, "profiles": profiles, "batches": list(BATCHES)})


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    fp32 = [r["max_abs_diff_vs_ort_cpu"] for r in rows if "max_abs_diff_vs_ort_cpu" in r and "fp32" in r["config"]]
    fp16 = [r["top1_agree_vs_ort_cpu"] for r in rows if "top1_agree_vs_ort_cpu" in r and "fp16" in r["config"]]
    if fp32:
        out.append(target("digits FP32 GPU max |logit diff| vs ORT CPU", max(fp32), 1e-4))
    if fp16:
        out.append(target("digits FP16 GPU top-1 agreement with ORT CPU", min(fp16), 0.99, op=">="))
    for model in ("cnn-large", "minilm"):
        gpu = [r["items_per_s_b64"] for r in rows if r["model"].startswith(model) and "graphs" in r["config"]]
        cpu = [r["items_per_s_b64"] for r in rows if r["model"].startswith(model) and "onnxruntime" in r["config"]]
        if gpu and cpu:
            out.append(target(f"{model} batch-64 throughput, best GPU / CPU 1 thread", max(gpu) / cpu[0], 1.0,
                              op=">=", unit="x"))
    return out


async def run_gpu_profile(ctx: RunContext) -> Path:
    return await asyncio.to_thread(_measure, ctx)


def pack_minilm(src: Path, out: Path, n_sentences: int = PROFILE_SENTENCES) -> Path:
    """Zero the word-embedding rows no profiling sentence uses, gzip; check outputs are unchanged."""
    import onnx
    from onnx import numpy_helper

    from variant_store.families.minilm import sentences, tokenize

    feeds = tokenize(sentences(n_sentences) + sentences(64, seed=1), src / "tokenizer.json")
    used = np.unique(feeds["input_ids"])
    model = onnx.load(str(src / "minilm-l6.fp32.onnx"))
    init = next(i for i in model.graph.initializer if i.name.endswith("word_embeddings.weight"))
    table = numpy_helper.to_array(init).copy()
    keep = np.zeros(len(table), bool)
    keep[used] = True
    table[~keep] = 0.0
    init.CopyFrom(numpy_helper.from_array(table, init.name))
    out.mkdir(parents=True, exist_ok=True)
    packed = out / "minilm-l6.fp32.onnx"
    packed.write_bytes(model.SerializeToString())
    import onnxruntime as ort

    def run(p: Path) -> np.ndarray:
        sess = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
        return np.asarray(sess.run(None, feeds)[0])

    if not np.array_equal(run(src / "minilm-l6.fp32.onnx"), run(packed)):
        raise RuntimeError("packed MiniLM differs from the full export on the profiling sentences")
    (out / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    with gzip.open(out / "minilm-l6.fp32.onnx.gz", "wb", compresslevel=6) as fh:
        fh.write(packed.read_bytes())
    packed.unlink()
    print(f"kept {keep.sum()} of {len(table)} embedding rows; outputs identical on "
          f"{len(feeds['input_ids'])} sentences -> {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["pack-minilm"] and len(args) == 3:
        pack_minilm(Path(args[1]), Path(args[2]))
        return 0
    from bench.common import run_standalone

    run_standalone("gpu_profile", "--quick" in args, run_gpu_profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
