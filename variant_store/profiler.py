"""Measure one variant on this host: accuracy on held-out data, load time, latency per batch size,
memory, and the providers that actually ran it.

Accuracy is measured here, never copied from a parent: top-1 against labels, or the mean cosine
similarity of outputs to a reference model's outputs (embeddings). Timing is bounded: each batch
size gets at most ``repeats`` runs and at most ``time_budget_s`` seconds, after one warm-up run.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mesh.cache import BoundedCache
from mesh.errors import ConfigError
from variant_store.hardware import hardware_class_for
from variant_store.meta import LatencyStats, Profile
from variant_store.runtimes import open_runtime, rss_bytes
from variant_store.runtimes.base import Runtime

__all__ = ["ProfileResult", "add_base_latency", "measure_accuracy", "profile_variant", "run_first_output", "timed_runs"]


@dataclass(slots=True)
class ProfileResult:
    accuracy: float
    metric: str
    load_ms: float
    latency: dict[int, LatencyStats]
    peak_memory_bytes: int
    providers: list[str]
    hardware_class: str
    runs: dict[int, int] = field(default_factory=dict)   # batch size -> timed runs actually done
    device_memory_bytes: int = 0                         # accelerator memory the loaded variant held

    def to_profile(self, measured_at: float | None = None) -> Profile:
        return Profile(hardware_class=self.hardware_class, load_ms=self.load_ms, latency=dict(self.latency),
                       peak_memory_bytes=self.peak_memory_bytes, providers=list(self.providers),
                       measured_at=time.time() if measured_at is None else measured_at)


def measure_accuracy(outputs: np.ndarray, y: np.ndarray | None, metric: str,
                     reference_outputs: np.ndarray | None = None) -> float:
    """Top-1 accuracy against labels, or mean cosine similarity to ``reference_outputs``."""
    if metric == "top1":
        if y is None:
            raise ConfigError("metric top1 needs labels")
        return float(np.mean(outputs.argmax(axis=1) == np.asarray(y).reshape(-1)))
    if metric == "cosine":
        if reference_outputs is None:
            raise ConfigError("metric cosine needs reference_outputs")
        a = outputs.reshape(len(outputs), -1).astype(np.float64)
        b = np.asarray(reference_outputs).reshape(len(outputs), -1).astype(np.float64)
        denom = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        return float(np.mean(np.sum(a * b, axis=1) / np.maximum(denom, 1e-12)))
    raise ConfigError(f"unknown metric {metric!r}; use 'top1' or 'cosine'")


def profile_variant(runtime_format: str, path: Path, x_holdout: np.ndarray, y_holdout: np.ndarray | None, *,
                    metric: str = "top1", batch_sizes: tuple[int, ...] = (1, 8, 32), repeats: int = 50,
                    reference_outputs: np.ndarray | None = None, input_name: str | None = None,
                    time_budget_s: float = 1.0, intra_op_threads: int = 1,
                    runtime_options: Mapping[str, Any] | None = None) -> ProfileResult:
    """Load the variant at ``path`` with the runtime for ``runtime_format``, measure it, unload it.

    ``runtime_options`` go to the runtime's constructor (``{"precision": "fp16"}`` for ``torch-cuda``).
    The hardware class comes from the providers that actually ran it: a GPU run is ``gpu-<model>``."""
    if len(x_holdout) == 0:
        raise ConfigError("profiling needs held-out inputs")
    if metric == "cosine" and reference_outputs is None:
        raise ConfigError("metric cosine needs reference_outputs")
    rss0 = rss_bytes()
    rt = open_runtime(runtime_format, Path(path), intra_op_threads=intra_op_threads, **dict(runtime_options or {}))
    rt.load_sync()
    try:
        name = input_name or rt.input_specs[0].name
        out_name = rt.output_specs[0].name
        x = np.ascontiguousarray(x_holdout, dtype=np.float32)
        outs = [rt.infer_sync({name: x[i:i + 256]})[out_name] for i in range(0, len(x), 256)]
        accuracy = measure_accuracy(np.concatenate(outs), y_holdout, metric, reference_outputs)
        peak = rss_bytes()
        latency: dict[int, LatencyStats] = {}
        runs: dict[int, int] = {}
        for bs in batch_sizes:
            times = timed_runs(rt, name, np.ascontiguousarray(np.resize(x, (bs, *x.shape[1:]))), repeats,
                                time_budget_s)
            arr = np.asarray(times)
            latency[bs] = LatencyStats(p50_ms=float(np.percentile(arr, 50)),
                                       p99_ms=float(np.percentile(arr, 99)))
            runs[bs] = len(times)
            peak = max(peak, rss_bytes())
        return ProfileResult(
            accuracy=accuracy, metric=metric, load_ms=rt.load_ms, latency=latency,
            # What loading and running it cost this process, never less than what the runtime holds.
            peak_memory_bytes=max(rt.memory_bytes, peak - rss0),
            providers=list(rt.providers_in_use),
            hardware_class=hardware_class_for(rt.providers_in_use), runs=runs,
            device_memory_bytes=rt.device_memory_bytes())
    finally:
        rt.unload_sync()


def timed_runs(rt: Runtime, name: str, batch: np.ndarray, repeats: int, time_budget_s: float) -> list[float]:
    """Milliseconds of ``repeats`` runs of ``batch`` after one warm-up run (the first allocates / resizes),
    stopping early once ``time_budget_s`` is spent (at least one run)."""
    rt.infer_sync({name: batch})
    times: list[float] = []
    deadline = time.perf_counter() + time_budget_s
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        rt.infer_sync({name: batch})
        times.append((time.perf_counter() - t0) * 1000.0)
        if time.perf_counter() > deadline:
            break
    return times


def add_base_latency(result: ProfileResult, base_path: Path, x_holdout: np.ndarray,
                     batch_sizes: tuple[int, ...], repeats: int, *, time_budget_s: float = 1.0) -> ProfileResult:
    """``result`` (a head's profile) with its backbone's load time and latency at each batch size added:
    a head is served behind its backbone, and the backbone is most of the cost (a text encoder is
    milliseconds, its linear head microseconds). Percentiles add as an upper bound. Not its memory: a
    site holds one backbone for all its heads, and placement and the host charge it once, as the
    backbone's own (``VariantInfo.from_meta(base_bytes=...)``, ``VariantHost``); added here too, a head
    would be charged its backbone twice (an INT8 encoder's 22 MiB head looked like 44 MiB to an edge)."""
    rt = open_runtime("onnx", Path(base_path), intra_op_threads=1)
    rt.load_sync()
    try:
        name = rt.input_specs[0].name
        for bs in batch_sizes:
            times = timed_runs(rt, name, np.resize(x_holdout, (bs, *x_holdout.shape[1:])), repeats, time_budget_s)
            head = result.latency.get(bs, LatencyStats(p50_ms=0.0, p99_ms=0.0))
            arr = np.asarray(times)
            result.latency[bs] = LatencyStats(p50_ms=head.p50_ms + float(np.percentile(arr, 50)),
                                              p99_ms=head.p99_ms + float(np.percentile(arr, 99)))
        result.load_ms += rt.load_ms
    finally:
        rt.unload_sync()
    return result


# Every head on one backbone is measured on the backbone's features of the same rows (a text encoder
# takes seconds over them, a head microseconds): computed once per (model bytes, rows) and reused.
_FEATURES: BoundedCache[tuple[str, str], np.ndarray] = BoundedCache(8)


def _rows_digest(x: np.ndarray) -> str:
    h = hashlib.sha256(f"{x.dtype.str}{x.shape}".encode())
    if x.dtype.hasobject:
        for item in x.reshape(-1).tolist():
            h.update(len(item).to_bytes(4, "little") + item)
    else:
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def run_first_output(path: Path, x: np.ndarray) -> np.ndarray:
    """The first output of the ONNX model at ``path`` for ``x`` fed to its first input, through the
    serving runtime (so a text model tokenizes as it does when served), 256 rows at a time. Callers
    must not write to the result (it may be shared with the next caller asking for the same rows)."""
    key = (hashlib.sha256(Path(path).read_bytes()).hexdigest(), _rows_digest(x))
    hit = _FEATURES.get(key)
    if hit is not None:
        return hit
    rt = open_runtime("onnx", Path(path), intra_op_threads=2)
    rt.load_sync()
    try:
        name, out = rt.input_specs[0].name, rt.output_specs[0].name
        feats = np.concatenate([rt.infer_sync({name: x[i:i + 256]})[out] for i in range(0, len(x), 256)])
    finally:
        rt.unload_sync()
    feats.flags.writeable = False
    return _FEATURES.put(key, feats)
