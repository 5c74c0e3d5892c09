"""What this machine can run, detected rather than assumed.

``onnxruntime-gpu`` lists the CUDA and TensorRT providers even on a host without a GPU and then
silently runs on the CPU, so a provider list alone proves nothing: a GPU counts only when a CUDA
device node exists *and* the provider is offered. The hardware class names the profile a variant's
timings belong to (``cpu-x86_64``, ``gpu-h100``). :func:`runtime_support` says, runtime by runtime,
what this site can run and why not; a GPU reached through PyTorch (``torch-cuda``) is a GPU class
of its own even where ONNX Runtime has only its CPU provider.

A site serves on such a GPU (:func:`torch_serving`) when a CUDA device node exists, ONNX Runtime cannot
use it, PyTorch can, and ``TIERMESH_TORCH_CUDA`` is not ``0``: its ONNX variants then run through the
``torch-cuda`` runtime (:func:`serving_runtime`) and its hardware class is the GPU's. Without a device
node torch is never imported (seconds and hundreds of megabytes an agent on a CPU host must not pay).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass

__all__ = [
    "RuntimeSupport",
    "capped_class",
    "cpu_cap_cores",
    "gpu_available",
    "gpu_model",
    "hardware_class_for",
    "local_hardware_class",
    "onnx_providers",
    "runnable_runtimes",
    "runtime_support",
    "serving_runtime",
    "short_gpu_model",
    "split_cap",
    "tensorrt_available",
    "torch_cuda_available",
    "torch_serving",
]

_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


def _cuda_device_nodes() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _ort_providers() -> list[str]:
    try:
        import onnxruntime as ort
    except ImportError:
        return []
    return list(ort.get_available_providers())


@functools.lru_cache(maxsize=1)
def gpu_model() -> str | None:
    """The first CUDA device's model, lower-cased and shortened (``"h100"``), or None."""
    if not _cuda_device_nodes() or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[0] if out.strip() else ""
    return short_gpu_model(first) if first else None


def short_gpu_model(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``, ``"NVIDIA GeForce RTX 4090"`` -> ``"rtx-4090"``:
    vendor words dropped, then words up to and including the first that holds a digit."""
    words = [w for w in re.split(r"[\s\-_]+", name.lower()) if w and w not in {"nvidia", "tesla", "geforce"}]
    out: list[str] = []
    for w in words:
        out.append(w)
        if any(c.isdigit() for c in w):
            break
    return "-".join(out) or "cuda"


@functools.lru_cache(maxsize=1)
def torch_cuda_available() -> tuple[bool, str]:
    """(True, short model) when PyTorch here can run kernels on a CUDA device; else (False, why not).

    Imports torch only when it is installed (seconds, once: the answer is cached)."""
    if importlib.util.find_spec("torch") is None:
        return False, "torch is not installed (pip install 'tiermesh[gpu]')"
    import torch

    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device"
    return True, gpu_model() or short_gpu_model(torch.cuda.get_device_name(0))


def gpu_available() -> tuple[bool, str]:
    """(True, model) when ONNX Runtime can really run on a CUDA GPU here; else (False, why not)."""
    if not _cuda_device_nodes():
        return False, "no CUDA device (/dev/nvidia* absent)"
    providers = _ort_providers()
    if "CUDAExecutionProvider" not in providers:
        return False, "CUDA device present but onnxruntime-gpu is not installed (CPU provider only)"
    model = gpu_model()
    if model is None:
        return False, "CUDA device node present but nvidia-smi reports no GPU"
    return True, model


def tensorrt_available() -> tuple[bool, str]:
    """(True, how) when TensorRT can run here: the ``tensorrt`` package with a CUDA GPU that torch
    reaches (engines need torch for device buffers), or ONNX Runtime's TensorRT provider on a GPU."""
    has_pkg = importlib.util.find_spec("tensorrt") is not None
    has_ep = "TensorrtExecutionProvider" in _ort_providers()
    if not has_pkg and not has_ep:
        return False, "neither the tensorrt package nor the onnxruntime TensorRT provider is installed"
    why = ""
    if has_pkg:
        ok, why = torch_cuda_available()
        if ok:
            return True, "tensorrt"
    if has_ep:
        ok, why = gpu_available()
        if ok:
            return True, "onnxruntime TensorRT execution provider"
    return False, f"TensorRT needs a GPU: {why}"


def onnx_providers(prefer_gpu: bool = True) -> list[str]:
    """Providers to ask ONNX Runtime for, best first; GPU ones only when a GPU is really usable."""
    available = _ort_providers()
    out: list[str] = []
    if prefer_gpu and gpu_available()[0]:
        out.extend(p for p in _GPU_PROVIDERS if p in available)
    out.append("CPUExecutionProvider")
    return out


def hardware_class_for(providers_in_use: list[str]) -> str:
    """The class a measurement belongs to, from the providers a session actually used."""
    if any(p in _GPU_PROVIDERS for p in providers_in_use):
        return f"gpu-{gpu_model() or 'cuda'}"
    if any(p.startswith("torch-cuda") for p in providers_in_use):
        ok, model = torch_cuda_available()
        return f"gpu-{model if ok else 'cuda'}"
    return f"cpu-{platform.machine().lower() or 'unknown'}"


@dataclass(frozen=True, slots=True)
class RuntimeSupport:
    """Whether one runtime can run on this site: ``detail`` is the GPU / provider, or why not."""

    runtime: str
    ok: bool
    detail: str


def _tflite() -> tuple[bool, str]:
    if importlib.util.find_spec("ai_edge_litert") is None:
        return False, "ai-edge-litert is not installed"
    return True, "ai-edge-litert"


def runtime_support() -> list[RuntimeSupport]:
    """Every runtime tiermesh knows, each with whether it can run here (detected, never assumed)."""
    providers = _ort_providers()
    gpu_ok, gpu_why = gpu_available()
    torch_ok, torch_why = torch_cuda_available()
    rows = [
        RuntimeSupport("onnxruntime-cpu", "CPUExecutionProvider" in providers,
                       "CPU provider" if providers else "onnxruntime is not installed"),
        RuntimeSupport("onnxruntime-cuda", gpu_ok, gpu_why),
        RuntimeSupport("onnxruntime-tensorrt", gpu_ok and "TensorrtExecutionProvider" in providers,
                       gpu_why if not gpu_ok else "TensorRT provider" if "TensorrtExecutionProvider" in providers
                       else "the onnxruntime TensorRT provider is not installed"),
        RuntimeSupport("tensorrt", torch_ok and importlib.util.find_spec("tensorrt") is not None,
                       torch_why if not torch_ok else "tensorrt" if importlib.util.find_spec("tensorrt")
                       else "the tensorrt package is not installed"),
        RuntimeSupport("torch-cuda", torch_ok, torch_why),
        RuntimeSupport("tflite", *_tflite()),
    ]
    return rows


def runnable_runtimes() -> list[str]:
    """Names of the runtimes from :func:`runtime_support` that can run here."""
    return [r.runtime for r in runtime_support() if r.ok]


def torch_serving() -> tuple[bool, str]:
    """(True, model) when this site serves its ONNX variants through PyTorch on a CUDA GPU; else why not."""
    if os.environ.get("TIERMESH_TORCH_CUDA", "1") == "0":
        return False, "TIERMESH_TORCH_CUDA=0"
    if not _cuda_device_nodes():
        return False, "no CUDA device (/dev/nvidia* absent)"
    if gpu_available()[0]:
        return False, "ONNX Runtime reaches the GPU itself"
    return torch_cuda_available()


def serving_runtime(fmt: str) -> str:
    """The runtime a variant of format ``fmt`` is served by here: ``torch-cuda`` for ONNX on a torch-served
    GPU (:func:`torch_serving`), else the format's own."""
    return "torch-cuda" if fmt == "onnx" and torch_serving()[0] else fmt


def local_hardware_class(cpu_cap: float | None = None) -> str:
    """``gpu-<model>`` when a CUDA device is usable by ONNX Runtime, or serves through PyTorch, here; else
    ``cpu-<arch>``; a CPU class under a CPU cap of ``cpu_cap`` cores is a class of its own
    (:func:`capped_class`)."""
    ok, model = gpu_available()
    if not ok:
        ok, model = torch_serving()
    if ok:
        return f"gpu-{model}"
    return capped_class(f"cpu-{platform.machine().lower() or 'unknown'}", cpu_cap)


def capped_class(base: str, cpu_cap: float | None) -> str:
    """``cpu-x86_64`` under a cap of 0.25 cores is ``cpu-x86_64-cap0.25``: a capped site runs slower than
    the machine its class names, so its timings are a profile of their own."""
    if cpu_cap is None:
        return base
    return f"{base}-cap{cpu_cap:.2f}"


_CAPPED = re.compile(r"^(?P<base>.+)-cap(?P<cores>\d+(?:\.\d+)?)$")


def split_cap(hardware_class: str) -> tuple[str, float | None]:
    """The inverse of :func:`capped_class`: ``cpu-x86_64-cap0.25`` is ``("cpu-x86_64", 0.25)``, an uncapped class
    ``(class, None)``."""
    m = _CAPPED.match(hardware_class)
    if m is None:
        return hardware_class, None
    return m["base"], float(m["cores"])


def _cgroup_cpu_file(line: str) -> str | None:
    """The quota file of one ``/proc/self/cgroup`` line, if it names the cpu controller."""
    _, controllers, path = line.split(":", 2)
    if controllers == "":  # cgroup v2
        for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
            if os.path.exists(f"{root}{path}/cpu.max"):
                return f"{root}{path}/cpu.max"
        return None
    if "cpu" not in controllers.split(","):
        return None
    for root in (f"/sys/fs/cgroup/{controllers}", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):
        if os.path.exists(f"{root}{path}/cpu.cfs_quota_us"):
            return f"{root}{path}/cpu.cfs_quota_us"
    return None


def cpu_cap_cores() -> float | None:
    """The CPU quota this process runs under, in cores (``None``: none, or none this process can read).

    Read from its own cgroup (v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` or v2 ``cpu.max``), so a
    site reports the cap it really has, whoever set it."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            path = _cgroup_cpu_file(line)
            if path is None:
                continue
            if path.endswith("cpu.max"):
                quota, period = open(path).read().split()[:2]
            else:
                quota = open(path).read().strip()
                period = open(path.replace("cfs_quota_us", "cfs_period_us")).read().strip()
        except (OSError, ValueError):
            continue
        if quota in ("max", "-1") or int(quota) <= 0:
            continue
        return int(quota) / int(period)
    return None
