"""``gpu_profile``: the digits and text families on a CUDA GPU through the torch-cuda runtime,
FP32 and FP16, CUDA graphs on and off, batch 1-64, beside ONNX Runtime on the same host's CPU.

Only on a host where PyTorch sees a GPU (``python -m bench --only gpu_profile``; it is not in the
default scenario list). Digits go through :func:`variant_store.profiler.profile_variant`, so the
profiles written under ``profiles`` are the catalog's own type, keyed by the hardware class the
profiler derived (``gpu-h100``, ``cpu-x86_64``). The text family's FP32 encoder runs where
:func:`bench.gpu_text.find_text_family` finds it (``TIERMESH_TEXT_FAMILY_DIR``, or the local cache);
``python -m bench.gpu_text pack OUT`` makes a copy small enough to travel to a lent GPU machine.
``scripts/device_gpu.sh`` is what such a machine runs: the ``gpu`` tests, then this scenario.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import MODELS_DIR, Panel, RunContext, plot_panels, target, write_result
from bench.gpu_text import find_text_family, profile_text
from variant_store.hardware import torch_cuda_available
from variant_store.meta import LatencyStats
from variant_store.profiler import profile_variant

__all__ = ["run_gpu_profile"]

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
    family = find_text_family()
    text_note = "Text family: not on this host (set TIERMESH_TEXT_FAMILY_DIR; `python -m bench.gpu_text pack`)"
    if family is not None:
        text_rows, curves["minilm-l6"], text_profiles = profile_text(
            family, CONFIGS, BATCHES, repeats=ctx.pick(30, 200), budget_s=0.5 if ctx.quick else 2.0)
        rows += text_rows
        profiles.update(text_profiles)
        text_note = ("Text family: the six-layer FP32 MiniLM encoder as served (text in, tokenized on the host, "
                     "embedding out), batches of the first held-out descriptions; cosine vs ORT CPU and both heads' "
                     "top-1 over the 848 held-out descriptions (heads on ORT CPU over each configuration's embeddings)")
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
    tr = [r for r in rows if r["config"].startswith("torch-cuda")]  # the GPU rows
    fp32 = [r["max_abs_diff_vs_ort_cpu"] for r in tr if "max_abs_diff_vs_ort_cpu" in r and "fp32" in r["config"]]
    fp16 = [r["top1_agree_vs_ort_cpu"] for r in tr if "top1_agree_vs_ort_cpu" in r and "fp16" in r["config"]]
    if fp32:
        out.append(target("digits FP32 GPU max |logit diff| vs ORT CPU", max(fp32), 1e-4))
    if fp16:
        out.append(target("digits FP16 GPU top-1 agreement with ORT CPU", min(fp16), 0.99, op=">="))
    fp16_text = [r["cosine_min_vs_ort_cpu"] for r in tr if r["task"] == "text-embedding" and "fp16" in r["config"]]
    if fp16_text:
        out.append(target("MiniLM FP16 GPU min cosine vs ORT CPU", min(fp16_text), 0.999, op=">="))
    for model in ("cnn-large", "minilm"):
        gpu = [r["items_per_s_b64"] for r in rows if r["model"].startswith(model) and "graphs" in r["config"]]
        cpu = [r["items_per_s_b64"] for r in rows if r["model"].startswith(model) and "onnxruntime" in r["config"]]
        if gpu and cpu:
            out.append(target(f"{model} batch-64 throughput, best GPU / CPU 1 thread", max(gpu) / cpu[0], 1.0,
                              op=">=", unit="x"))
    return out


async def run_gpu_profile(ctx: RunContext) -> Path:
    return await asyncio.to_thread(_measure, ctx)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    from bench.common import run_standalone

    run_standalone("gpu_profile", "--quick" in args, run_gpu_profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
