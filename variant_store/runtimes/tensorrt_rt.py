"""TensorRT engines on GPU core sites.

Two ways in, tried in order: a serialized engine (``.engine`` / ``.plan``) through the
``tensorrt`` package, or an ONNX file through ONNX Runtime's TensorRT execution provider. Neither
can be installed on CPU-only hosts; ``available()`` says why, and loading raises
``RuntimeLoadError`` with that reason instead of quietly running somewhere else.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np

from mesh.errors import RuntimeLoadError
from mesh.types import TensorSpec
from variant_store.hardware import tensorrt_available
from variant_store.runtimes.base import Runtime
from variant_store.runtimes.onnx_rt import OnnxRuntime

__all__ = ["EngineRunner", "TensorRTRuntime", "available"]


def available() -> tuple[bool, str]:
    """(True, how) when TensorRT can run here, else (False, reason)."""
    return tensorrt_available()


class TensorRTRuntime(Runtime):
    name = "tensorrt"

    def _load(self) -> None:
        ok, why = available()
        if not ok:
            raise RuntimeLoadError(f"tensorrt unavailable: {why}", path=str(self.model_path))
        if self.model_path.suffix == ".onnx":
            self._load_ort_trt()
        else:
            self._load_engine()

    def _load_ort_trt(self) -> None:
        # The TensorRT EP compiles the ONNX graph into an engine on first load (can take a while).
        inner = OnnxRuntime(self.model_path, intra_op_threads=self.intra_op_threads,
                            providers=["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                       "CPUExecutionProvider"])
        inner.load_sync()
        if "TensorrtExecutionProvider" not in inner.providers_in_use:
            inner.unload_sync()
            raise RuntimeLoadError("onnxruntime did not enable the TensorRT provider",
                                   providers=inner.providers_in_use)
        self._ort: OnnxRuntime | None = inner
        self.input_specs, self.output_specs = inner.input_specs, inner.output_specs
        self.providers_in_use = inner.providers_in_use

    def _load_engine(self) -> None:
        try:
            import tensorrt as trt
            import torch  # device buffers; tensorrt itself ships no allocator for Python
        except ImportError as exc:
            raise RuntimeLoadError(f"tensorrt engine files need tensorrt and torch (pip install "
                                   f"'tiermesh[gpu]'): {exc}") from exc
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(self.model_path.read_bytes())
        if engine is None:
            raise RuntimeLoadError(f"tensorrt could not deserialize {self.model_path.name}")
        self._ort = None
        # the trt.Runtime must outlive the engines it deserialised
        self._runner: EngineRunner | None = EngineRunner(engine, trt, torch, keep=runtime)
        self.input_specs, self.output_specs = self._runner.input_specs, self._runner.output_specs
        self.providers_in_use = ["tensorrt"]

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._ort is not None:
            return self._ort.run_checked_sync(inputs)  # InferenceSession.run is thread-safe
        assert self._runner is not None
        return self._runner.run(inputs)

    def _close(self) -> None:
        if getattr(self, "_ort", None) is not None:
            self._ort.unload_sync()  # type: ignore[union-attr]
        self._ort = None
        self._runner = None


class EngineRunner:
    """Runs a deserialised engine from any number of threads.

    An ``IExecutionContext`` holds the input shapes and tensor addresses of one inference, so
    two threads sharing one would overwrite each other's bindings between ``set_tensor_address``
    and ``execute_async_v3``. Each call therefore borrows a context (with its own CUDA stream)
    from a pool and returns it afterwards; the pool grows to the number of concurrent callers.
    Outputs come back in the dtypes the engine declares (an FP16 engine may return float16).
    """

    def __init__(self, engine: Any, trt: Any, torch: Any, keep: Any = None) -> None:
        self.engine, self.trt, self.torch, self._keep = engine, trt, torch, keep
        self._idle: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self.contexts_created = 0
        self._count_lock = threading.Lock()
        ins: list[TensorSpec] = []
        outs: list[TensorSpec] = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            spec = TensorSpec(name, np.dtype(trt.nptype(engine.get_tensor_dtype(name))).name,
                              tuple(int(d) for d in engine.get_tensor_shape(name)))
            (ins if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else outs).append(spec)
        self.input_specs, self.output_specs = ins, outs

    def _borrow(self) -> tuple[Any, Any]:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            ctx = self.engine.create_execution_context()
            if ctx is None:
                raise RuntimeLoadError("tensorrt could not create an execution context (GPU memory?)") from None
            with self._count_lock:
                self.contexts_created += 1
            return ctx, self.torch.cuda.Stream()

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.torch
        ctx, stream = self._borrow()
        try:
            keep: list[Any] = []
            for spec in self.input_specs:
                t = torch.from_numpy(inputs[spec.name]).to("cuda")
                ctx.set_input_shape(spec.name, tuple(t.shape))
                ctx.set_tensor_address(spec.name, t.data_ptr())
                keep.append(t)
            outs: dict[str, Any] = {}
            for spec in self.output_specs:
                shape = tuple(ctx.get_tensor_shape(spec.name))
                t = torch.empty(shape, dtype=getattr(torch, spec.dtype), device="cuda")
                ctx.set_tensor_address(spec.name, t.data_ptr())
                outs[spec.name] = t
            # the input copies ran on the current stream: the engine's stream must wait for them
            stream.wait_stream(torch.cuda.current_stream())
            if not ctx.execute_async_v3(stream.cuda_stream):
                raise RuntimeLoadError("tensorrt execution failed")
            stream.synchronize()
            return {k: v.cpu().numpy() for k, v in outs.items()}
        finally:
            self._idle.put((ctx, stream))
