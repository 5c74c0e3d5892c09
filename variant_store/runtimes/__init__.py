"""Runtimes behind one interface; ``open_runtime`` picks the implementation from a variant's format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mesh.errors import RuntimeLoadError
from variant_store.runtimes.base import Runtime, rss_bytes
from variant_store.runtimes.onnx_rt import OnnxRuntime
from variant_store.runtimes.tensorrt_rt import TensorRTRuntime
from variant_store.runtimes.tflite_rt import TFLiteRuntime
from variant_store.runtimes.torch_cuda import TorchCudaRuntime

__all__ = [
    "OnnxRuntime",
    "Runtime",
    "TFLiteRuntime",
    "TensorRTRuntime",
    "TorchCudaRuntime",
    "open_runtime",
    "rss_bytes",
    "runtime_class",
]

_BY_KEY: dict[str, type[Runtime]] = {
    "onnx": OnnxRuntime,
    "onnxruntime": OnnxRuntime,
    "tflite": TFLiteRuntime,
    "tensorrt": TensorRTRuntime,
    "torch-cuda": TorchCudaRuntime,
}


def runtime_class(meta_format: str) -> type[Runtime]:
    """The implementation for a variant format (``onnx`` / ``tflite`` / ``tensorrt``) or runtime name
    (``onnxruntime`` / ``torch-cuda``: an ONNX file run by PyTorch on a GPU)."""
    try:
        return _BY_KEY[meta_format]
    except KeyError:
        raise RuntimeLoadError(f"no runtime for format {meta_format!r}; known: {sorted(_BY_KEY)}") from None


def open_runtime(meta_format: str, path: Path, **kw: Any) -> Runtime:
    """A new, not yet loaded runtime for the model at ``path``; ``kw`` goes to the constructor."""
    return runtime_class(meta_format)(Path(path), **kw)
