"""TFLite through ``ai_edge_litert``: callers pass float32 and get float32, whatever the model stores.

A full-integer model takes int8 input and gives int8 output; this runtime quantizes inputs with
the input tensor's scale / zero point and dequantizes outputs, so an int8 TFLite variant has the
same signature as its FP32 ONNX parent. The interpreter is resized to each batch. One
interpreter is not thread-safe, hence the lock around set / invoke / get.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from mesh.errors import RuntimeLoadError
from mesh.types import TensorSpec
from variant_store.runtimes.base import Runtime

__all__ = ["TFLiteRuntime"]

_QUANT_DTYPES = {np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int16)}


def _signature_shape(detail: dict[str, Any]) -> tuple[int, ...]:
    sig = detail.get("shape_signature")
    shape = sig if sig is not None and len(sig) else detail["shape"]
    return tuple(int(d) for d in shape)


def _public_dtype(detail: dict[str, Any]) -> str:
    dt = np.dtype(detail["dtype"])
    return "float32" if dt in _QUANT_DTYPES else dt.name


class TFLiteRuntime(Runtime):
    name = "tflite"

    def _prime(self) -> None:
        """Import the interpreter before the first variant's load is measured (``Runtime.load_sync``): the import
        alone is ~9 MB of RSS that the first TFLite variant loaded was measured as holding (12.6 MB for a 4.8 KB
        model; 3.3 MB after it, XNNPACK's own first set-up, which needs a model to happen)."""
        import contextlib

        with contextlib.suppress(ImportError):  # the load itself says it is not installed
            import ai_edge_litert.interpreter  # noqa: F401

    def _load(self) -> None:
        try:
            from ai_edge_litert.interpreter import Interpreter
        except ImportError as exc:
            raise RuntimeLoadError("ai_edge_litert is not installed") from exc
        try:
            interp = Interpreter(model_path=str(self.model_path), num_threads=self.intra_op_threads)
            interp.allocate_tensors()
        except (ValueError, RuntimeError) as exc:
            raise RuntimeLoadError(f"tflite could not load {self.model_path.name}: {exc}",
                                   path=str(self.model_path)) from exc
        self._interp = interp
        self._lock = threading.Lock()
        self._in = interp.get_input_details()
        self._out = interp.get_output_details()
        self._shapes = {d["index"]: tuple(int(x) for x in d["shape"]) for d in self._in}
        self.input_specs = [TensorSpec(d["name"], _public_dtype(d), _signature_shape(d)) for d in self._in]
        self.output_specs = [TensorSpec(d["name"], _public_dtype(d), _signature_shape(d)) for d in self._out]
        self.providers_in_use = ["tflite-cpu"]

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            resized = False
            for d in self._in:
                shape = tuple(inputs[d["name"]].shape)
                if self._shapes[d["index"]] != shape:
                    self._interp.resize_tensor_input(d["index"], list(shape))
                    self._shapes[d["index"]] = shape
                    resized = True
            if resized:
                self._interp.allocate_tensors()
            for d in self._in:
                self._interp.set_tensor(d["index"], _quantize(inputs[d["name"]], d))
            self._interp.invoke()
            return {d["name"]: _dequantize(self._interp.get_tensor(d["index"]), d) for d in self._out}

    def _close(self) -> None:
        self._interp = None  # type: ignore[assignment]


def _quantize(x: np.ndarray, detail: dict[str, Any]) -> np.ndarray:
    dt = np.dtype(detail["dtype"])
    if dt not in _QUANT_DTYPES:
        return x.astype(dt, copy=False)
    scale, zero = detail["quantization"]
    info = np.iinfo(dt)
    q = np.round(x / np.float32(scale)) + zero
    return np.clip(q, info.min, info.max).astype(dt)


def _dequantize(q: np.ndarray, detail: dict[str, Any]) -> np.ndarray:
    if np.dtype(detail["dtype"]) not in _QUANT_DTYPES:
        return np.array(q, dtype=np.float32, copy=True)
    scale, zero = detail["quantization"]
    return ((q.astype(np.float32) - np.float32(zero)) * np.float32(scale)).astype(np.float32)
