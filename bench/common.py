"""Shared pieces of the benchmark suite: run context, interleaved measurement, statistics, targets,
the results JSON (with machine, versions and git commit) and PNG plots (matplotlib, Agg backend).

Every scenario measures its floor in the same run as the system, alternating the two in rounds,
because this machine is shared and noisy: a floor measured an hour earlier says nothing about now.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = [
    "REPO_ROOT",
    "RESULTS_DIR",
    "Panel",
    "RunContext",
    "closed_loop_rate",
    "compute_model",
    "digits_model",
    "digits_rows",
    "git_commit",
    "interleave",
    "machine_info",
    "percentile",
    "plot_panels",
    "ratio",
    "summarize",
    "target",
    "versions",
    "write_result",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
MODELS_DIR = REPO_ROOT / "variant_store" / "models" / "digits"
CACHE_DIR = REPO_ROOT / ".tiermesh" / "bench-models"
Call = Callable[[], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class RunContext:
    """What every scenario is told: quick or full, where to write, and the command that ran it."""

    quick: bool
    results_dir: Path = RESULTS_DIR
    command: str = "python -m bench"

    def pick(self, quick: int, full: int) -> int:
        return quick if self.quick else full


def run_standalone(module: str, quick: bool,
                   scenario: Callable[[RunContext], Coroutine[Any, Any, Path]]) -> dict[str, Any]:
    """Run one scenario as ``python -m bench.<module> [--quick]`` would; returns the document it wrote."""
    ctx = RunContext(quick=quick, command=f"python -m bench.{module}" + (" --quick" if quick else ""))
    path: Path = asyncio.run(scenario(ctx))
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


# ------------------------------------------------------------------ statistics


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The ``q``-th percentile (0..100, linear interpolation); NaN for no values."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return float("nan")
    return float(np.percentile(arr, q))


def summarize(samples_s: Sequence[float] | np.ndarray) -> dict[str, float]:
    """Median / p99 / mean in microseconds of latencies given in seconds, and their count."""
    us = np.asarray(samples_s, dtype=float) * 1e6
    return {"median_us": round(percentile(us, 50), 1), "p99_us": round(percentile(us, 99), 1),
            "mean_us": round(float(us.mean()), 1) if us.size else float("nan"), "n": int(us.size)}


def ratio(system: float, floor: float) -> float:
    """``system / floor``, rounded to 3 places; NaN when the floor is not a positive number."""
    if not (floor > 0) or not np.isfinite(floor) or not np.isfinite(system):
        return float("nan")
    return round(system / floor, 3)


def target(name: str, measured: float, limit: float, *, op: Literal["<=", ">="] = "<=",
           unit: str = "") -> dict[str, Any]:
    """One target row: ``met`` is False for a NaN measurement (not measured is not met)."""
    ok = bool(np.isfinite(measured)) and (measured <= limit if op == "<=" else measured >= limit)
    return {"name": name, "target": limit, "op": op, "unit": unit,
            "measured": None if not np.isfinite(measured) else _shown(float(measured)), "met": ok}


def _shown(v: float) -> float:
    # three decimals, but three significant digits for a tiny value (an FP32 error of 1e-5 is not 0.0)
    return round(v, 3) if abs(v) >= 0.01 or v == 0.0 else float(f"{v:.3g}")


# ------------------------------------------------------------------ measurement


async def interleave(calls: Mapping[str, Call], *, rounds: int, per_round: int, warmup: int = 20,
                     time_cap_s: float = 60.0) -> dict[str, list[float]]:
    """Latency samples (seconds) per label: in each round every call runs ``per_round`` times in
    turn, the order reversed every other round so neither side always runs on a warmer cache.
    Stops early after ``time_cap_s`` (every label keeps the same number of completed rounds)."""
    labels = list(calls)
    out: dict[str, list[float]] = {lab: [] for lab in labels}
    for lab in labels:
        for _ in range(warmup):
            await calls[lab]()
    clock = time.perf_counter
    started = clock()
    for r in range(max(1, rounds)):
        order = labels if r % 2 == 0 else labels[::-1]
        for lab in order:
            fn = calls[lab]
            times = out[lab]
            for _ in range(per_round):
                t = clock()
                await fn()
                times.append(clock() - t)
        if clock() - started > time_cap_s:
            break
    return out


async def closed_loop_rate(call: Call, *, total: int, concurrency: int, time_cap_s: float = 30.0) -> float:
    """Completed calls per second with ``concurrency`` callers sharing ``total`` calls (or fewer,
    if ``time_cap_s`` runs out first)."""
    left = total
    done = 0
    deadline = time.perf_counter() + time_cap_s

    async def worker() -> None:
        nonlocal left, done
        while left > 0 and time.perf_counter() < deadline:
            left -= 1
            await call()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    elapsed = time.perf_counter() - t0
    return done / elapsed if elapsed > 0 else float("nan")


# ------------------------------------------------------------------ provenance


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "python": platform.python_version(), "platform": platform.platform()}


def versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for dist in ("numpy", "onnxruntime", "pyzmq", "aiohttp"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def git_commit(repo: Path = REPO_ROOT) -> str:
    """HEAD's hash, with ``+dirty`` when the working tree has changes; ``unknown`` outside git;
    ``TIERMESH_SOURCE_COMMIT`` when set (a tree copied elsewhere says what it was copied from). What the
    benchmarks write themselves (``bench/results``, ``BENCHMARKS.md``) does not count: a run would
    otherwise mark its own later scenarios dirty with the files its earlier ones wrote."""
    copied_from = os.environ.get("TIERMESH_SOURCE_COMMIT")
    if copied_from:  # a tree copied to another machine (a lent GPU): its .git, if any, is not this tree's
        return copied_from
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)bench/results", ":(exclude)BENCHMARKS.md"], cwd=repo,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_result(ctx: RunContext, scenario: str, rows: list[dict[str, Any]], targets: list[dict[str, Any]],
                 *, notes: str = "", extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``<results_dir>/<scenario>.json`` in the suite's schema; returns its path."""
    doc: dict[str, Any] = {
        "scenario": scenario, "machine": machine_info(), "versions": versions(), "git_commit": git_commit(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"), "quick": ctx.quick,
        "command": ctx.command, "notes": notes, "rows": rows, "targets": targets,
    }
    if extra:
        doc.update(extra)
    # every scenario says what it ran under: a mesh's per-site caps (extra["caps"]), else none
    doc.setdefault("caps", {"capped": False, "why": "no site caps: the scenario runs in one process or uncapped"})
    doc["machine"]["loadavg_at_write"] = [round(v, 2) for v in os.getloadavg()]
    doc = _finite(doc)
    ctx.results_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.results_dir / f"{scenario}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False, default=_json_default) + "\n")
    tmp.replace(path)  # a half-written file must never be picked up by the report
    return path


def _finite(obj: Any) -> Any:
    # JSON has no NaN: a value that could not be measured is written as null
    if isinstance(obj, float | np.floating):
        return float(obj) if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _json_default(obj: object) -> object:
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


# ------------------------------------------------------------------ plots


@dataclass(frozen=True, slots=True)
class Panel:
    """One bar chart: ``series`` label -> one value per group; ``labels`` optional text over bars."""

    title: str
    ylabel: str
    groups: list[str]
    series: dict[str, list[float]]
    log_y: bool = False
    bar_text: dict[str, list[str]] = field(default_factory=dict)


def plot_panels(path: Path, title: str, panels: Sequence[Panel]) -> Path:
    """Grouped bar charts side by side, saved as PNG (Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, p in zip(axes[0], panels, strict=True):
        n = max(1, len(p.series))
        width = 0.8 / n
        x = np.arange(len(p.groups))
        for i, (label, values) in enumerate(p.series.items()):
            vals = [v if np.isfinite(v) else 0.0 for v in values]
            bars = ax.bar(x + (i - (n - 1) / 2) * width, vals, width, label=label)
            for bar, text in zip(bars, p.bar_text.get(label, []), strict=False):
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, p.groups)
        ax.set_title(p.title, fontsize=10)
        ax.set_ylabel(p.ylabel)
        if p.log_y:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ models


def digits_model(preferred: Sequence[str], hidden: tuple[int, ...]) -> tuple[Path, str]:
    """(path, provenance) of a real digits model: the first of ``preferred`` committed under
    ``variant_store/models/digits/``, else an sklearn MLP with ``hidden`` layers trained on the
    bundled digits set and exported to ONNX (cached under ``.tiermesh/``)."""
    for name in preferred:
        path = MODELS_DIR / name
        if path.is_file():
            return path, f"committed {path.relative_to(REPO_ROOT)}"
    path = CACHE_DIR / f"sklearn-mlp-{'x'.join(map(str, hidden))}.onnx"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(_train_sklearn_mlp(hidden))
        tmp.replace(path)
    return path, f"sklearn MLP {hidden} trained on sklearn digits ({path.name})"


def _train_sklearn_mlp(hidden: tuple[int, ...]) -> bytes:
    # the same recipe as tests/helpers_models.py (bench/ must not import tests/): Gemm + Relu
    import warnings

    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from sklearn.datasets import load_digits
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    ds = load_digits()
    x = (ds.data / 16.0).astype(np.float32)
    clf = MLPClassifier(hidden_layer_sizes=hidden, activation="relu", max_iter=200, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(x, ds.target)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    prev = "x"
    for i, (w, b) in enumerate(zip(clf.coefs_, clf.intercepts_, strict=True)):
        last = i == len(clf.coefs_) - 1
        inits += [numpy_helper.from_array(np.ascontiguousarray(w.T, dtype=np.float32), f"fc{i}.weight"),
                  numpy_helper.from_array(b.astype(np.float32), f"fc{i}.bias")]
        out = "logits" if last else f"fc{i}_out"
        nodes.append(helper.make_node("Gemm", [prev, f"fc{i}.weight", f"fc{i}.bias"], [out], transB=1))
        if not last:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i}"]))
            prev = f"relu{i}"
    graph = helper.make_graph(nodes, "digits_mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tiermesh-bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def compute_model(infer: Callable[[dict[str, np.ndarray]], object], input_name: str,
                  features: int = 64) -> Callable[[int], float]:
    """A linear compute-time model (ms per batch of n rows) fitted to runs at 1 and 32 rows, as the
    profiler would give the batcher."""
    rng = np.random.default_rng(0)
    ms = {}
    for n in (1, 32):
        x = rng.random((n, features), dtype=np.float32)
        for _ in range(5):
            infer({input_name: x})
        t = time.perf_counter()
        for _ in range(20):
            infer({input_name: x})
        ms[n] = (time.perf_counter() - t) / 20 * 1000.0
    slope = max(0.0, (ms[32] - ms[1]) / 31)
    base = max(0.001, ms[1] - slope)
    return lambda n: base + slope * n


def digits_rows(n: int) -> np.ndarray:
    from sklearn.datasets import load_digits

    return (load_digits().data[:n] / 16.0).astype(np.float32)
