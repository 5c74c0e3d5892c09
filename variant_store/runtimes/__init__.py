"""Runtimes behind one interface; ``open_runtime`` picks the implementation from a variant's format.

Each implementation's module is imported when its format is first asked for, so a process that only
ever opens ONNX models (or none: an idle edge agent) never loads the TFLite, TensorRT or PyTorch
adapters.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.errors import RuntimeLoadError
from variant_store.runtimes.base import Runtime, rss_bytes

if TYPE_CHECKING:
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

# class name -> the module that defines it
_MODULES = {
    "OnnxRuntime": "variant_store.runtimes.onnx_rt",
    "TFLiteRuntime": "variant_store.runtimes.tflite_rt",
    "TensorRTRuntime": "variant_store.runtimes.tensorrt_rt",
    "TorchCudaRuntime": "variant_store.runtimes.torch_cuda",
}
# variant format or runtime name -> class name
_BY_KEY = {
    "onnx": "OnnxRuntime",
    "onnxruntime": "OnnxRuntime",
    "tflite": "TFLiteRuntime",
    "tensorrt": "TensorRTRuntime",
    "torch-cuda": "TorchCudaRuntime",
}


def __getattr__(name: str) -> type[Runtime]:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls: type[Runtime] = getattr(importlib.import_module(_MODULES[name]), name)
    return cls


def runtime_class(meta_format: str) -> type[Runtime]:
    """The implementation for a variant format (``onnx`` / ``tflite`` / ``tensorrt``) or runtime name
    (``onnxruntime`` / ``torch-cuda``: an ONNX file run by PyTorch on a GPU)."""
    try:
        name = _BY_KEY[meta_format]
    except KeyError:
        raise RuntimeLoadError(f"no runtime for format {meta_format!r}; known: {sorted(_BY_KEY)}") from None
    return __getattr__(name)


def open_runtime(meta_format: str, path: Path, **kw: Any) -> Runtime:
    """A new, not yet loaded runtime for the model at ``path``; ``kw`` goes to the constructor."""
    return runtime_class(meta_format)(Path(path), **kw)
