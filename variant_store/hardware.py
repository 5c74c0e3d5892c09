"""What this machine can run, detected rather than assumed.

``onnxruntime-gpu`` lists the CUDA and TensorRT providers even on a host without a GPU and then
silently runs on the CPU, so a provider list alone proves nothing: a GPU counts only when a CUDA
device node exists *and* the provider is offered. The hardware class names the profile a variant's
timings belong to (``cpu-x86_64``, ``gpu-h100``).
"""

from __future__ import annotations

import functools
import glob
import platform
import re
import shutil
import subprocess

__all__ = [
    "gpu_available",
    "gpu_model",
    "hardware_class_for",
    "local_hardware_class",
    "onnx_providers",
    "tensorrt_available",
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
    if not first:
        return None
    words = [w for w in re.split(r"[\s\-_]+", first.lower()) if w not in {"nvidia", "tesla", "geforce"}]
    return words[0] if words else "cuda"


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
    ok, why = gpu_available()
    if not ok:
        return False, f"TensorRT needs a GPU: {why}"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        if "TensorrtExecutionProvider" in _ort_providers():
            return True, "onnxruntime TensorRT execution provider"
        return False, "neither the tensorrt package nor the onnxruntime TensorRT provider is installed"
    return True, "tensorrt"


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
    return f"cpu-{platform.machine().lower() or 'unknown'}"


def local_hardware_class() -> str:
    """``gpu-<model>`` when a CUDA device is usable by ONNX Runtime here, else ``cpu-<arch>``."""
    ok, model = gpu_available()
    if ok:
        return f"gpu-{model}"
    return f"cpu-{platform.machine().lower() or 'unknown'}"
