"""ONNX variants run through PyTorch on a CUDA GPU: the GPU runtime that needs no onnxruntime-gpu.

The graph is interpreted by :class:`~variant_store.runtimes.onnx_torch.TorchGraph` (FP32, or FP16
weights and activations with outputs cast back to the declared dtype). Small models are bound by
launch overhead, not arithmetic: an interpreted MLP issues a handful of kernels, each costing a
few microseconds of Python and driver time, so by default every input shape seen is captured once
as a CUDA graph and later calls replay it (one launch). Shapes beyond ``max_graphs`` run eagerly;
a graph whose capture fails (an op that syncs with the host) falls back to eager for that shape,
and ``graph_failures`` says so.

Thread safety: one lock for every torch-cuda runtime of the process, around each load, call and
unload. A replayed graph reads and writes fixed device buffers, so two threads must not interleave on
one graph; and while one thread captures a graph, CUDA forbids other threads' allocations and syncs
(a site loading one variant while it profiles another failed so). The GPU runs one stream's kernels
in order anyway, so the lock costs little beyond the host copies it also serialises. Anything torch
raises while loading is a ``RuntimeLoadError``: the site then serves the file on its CPU instead.
``device="cpu"`` runs the same graph on the CPU (for tests on machines without a GPU).

A text model (the text family's encoders) carries its tokenizer in its metadata, as for ONNX Runtime
(:mod:`variant_store.runtimes.text`): the runtime takes the BYTES ``text`` tensor and tokenizes on the
host before the graph runs; each padded length is its own input shape (its own CUDA graph).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from mesh.errors import RuntimeLoadError
from variant_store.hardware import torch_cuda_available
from variant_store.runtimes.base import Runtime
from variant_store.runtimes.text import TEXT_SPEC, TextFront, text_front

__all__ = ["TorchCudaRuntime"]

# one for the process: see the module docstring (capture excludes every other thread's CUDA work)
_CUDA_LOCK = threading.RLock()
_PRIMED: set[str] = set()  # devices whose CUDA context this process has created (TorchCudaRuntime._prime)


class TorchCudaRuntime(Runtime):
    name = "torch-cuda"

    def __init__(self, model_path: Any, *, intra_op_threads: int = 1, providers: list[str] | None = None,
                 precision: str = "fp32", cuda_graphs: bool = True, device: str = "cuda",
                 max_graphs: int = 16) -> None:
        super().__init__(model_path, intra_op_threads=intra_op_threads, providers=providers)
        if precision not in ("fp32", "fp16"):
            raise RuntimeLoadError(f"torch-cuda: precision must be fp32 or fp16, got {precision!r}")
        self.precision = precision
        self.device = device
        self.cuda_graphs = cuda_graphs and device.startswith("cuda")
        self.max_graphs = max_graphs
        self.graph_failures: dict[tuple[Any, ...], str] = {}
        self._lock = _CUDA_LOCK
        self._graphs: dict[tuple[Any, ...], tuple[Any, dict[str, Any], dict[str, Any]]] = {}
        self._graph: Any = None
        self._torch: Any = None
        self._text: TextFront | None = None
        self._device_bytes = 0

    def _prime(self) -> None:
        """Create the device's CUDA context and load the math libraries (import torch, one matmul, one
        convolution) before the first load is measured: they are the process's, not the first variant's (the
        H200 run measured the first variant at 119 MiB, the same file's next load at 76 MiB; its file is
        50 KB). Not yet checked on a GPU: tests/gpu has the check (a fresh process's first load)."""
        if self.device in _PRIMED:
            return
        try:
            import onnx  # noqa: F401  (the interpreter reads the file with it)
            import torch
        except ImportError:
            return  # _load says so, with the reason
        on_cuda = self.device.startswith("cuda")
        if on_cuda and not torch_cuda_available()[0]:
            return
        with self._lock:
            try:
                a = torch.ones(8, 8, device=self.device)
                (a @ a).sum().item()  # the context, the caching allocator, cuBLAS
                torch.nn.functional.conv2d(a.view(1, 1, 8, 8), a[:3, :3].reshape(1, 1, 3, 3)).sum().item()  # cuDNN
                if on_cuda:
                    torch.cuda.synchronize()
            except Exception:  # a device that fails here fails _load too, which says why
                return
            _PRIMED.add(self.device)

    def _load(self) -> None:
        if self.device.startswith("cuda"):
            ok, why = torch_cuda_available()
            if not ok:
                raise RuntimeLoadError(f"torch-cuda unavailable: {why}", path=str(self.model_path))
        try:
            import onnx
            import torch
        except ImportError as exc:
            raise RuntimeLoadError(f"torch runtime needs torch and onnx: {exc}") from exc
        from variant_store.runtimes.onnx_torch import TorchGraph

        try:
            model = onnx.load(str(self.model_path))
        except Exception as exc:  # onnx raises DecodeError / ValidationError, untyped here
            raise RuntimeLoadError(f"torch runtime could not read {self.model_path.name}: {exc}",
                                   path=str(self.model_path)) from exc
        on_cuda = self.device.startswith("cuda")
        if on_cuda and self.precision == "fp32":
            # FP32 means IEEE FP32: cuDNN convolutions default to TF32 (10-bit mantissa) on Ampere and
            # later, which moves logits by ~1e-3 and would make FP32 variants disagree with ONNX Runtime.
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        with self._lock:
            try:
                before = torch.cuda.memory_allocated() if on_cuda else 0
                graph = TorchGraph(model, self.device, half=self.precision == "fp16")
                if on_cuda:
                    torch.cuda.synchronize()
                    self._device_bytes = torch.cuda.memory_allocated() - before
            except RuntimeLoadError:
                raise
            except Exception as exc:  # torch's errors are plain RuntimeErrors (CUDA state, memory)
                raise RuntimeLoadError(f"torch-cuda could not load {self.model_path.name}: {exc}",
                                       path=str(self.model_path)) from exc
        self._torch = torch
        self._graph = graph
        self.input_specs, self.output_specs = self._graph.input_specs, self._graph.output_specs
        self._text = text_front({p.key: p.value for p in model.metadata_props},
                                tuple(s.name for s in self.input_specs))
        if self._text is not None:
            self.input_specs = [TEXT_SPEC]
        mode = "graphs" if self.cuda_graphs else "eager"
        self.providers_in_use = [f"torch-{'cuda' if on_cuda else 'cpu'}-{self.precision}-{mode}"]

    def device_memory_bytes(self) -> int:
        return self._device_bytes

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        if self._text is not None:
            inputs = self._text.encode(inputs["text"])
        with self._lock, torch.inference_mode():
            key = tuple((n, a.shape, a.dtype.str) for n, a in inputs.items())
            if self.cuda_graphs and key not in self.graph_failures and (
                    key in self._graphs or len(self._graphs) < self.max_graphs):
                entry = self._graphs.get(key) or self._capture(key, inputs)
                if entry is not None:
                    graph, static_in, static_out = entry
                    for name, arr in inputs.items():
                        static_in[name].copy_(torch.from_numpy(arr), non_blocking=False)
                    graph.replay()
                    return {n: t.cpu().numpy() for n, t in static_out.items()}
            dev = {n: torch.from_numpy(a).to(self.device) for n, a in inputs.items()}
            return {n: t.cpu().numpy() for n, t in self._graph(dev).items()}

    def _capture(self, key: tuple[Any, ...], inputs: dict[str, np.ndarray]) -> Any:
        """Capture one forward pass for this input shape; None (and eager from now on) if it cannot."""
        torch = self._torch
        static_in = {n: torch.from_numpy(a).to(self.device) for n, a in inputs.items()}
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
                for _ in range(2):
                    self._graph(static_in)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self._graph(static_in)
        except Exception as exc:  # capture errors are plain RuntimeErrors from the CUDA runtime
            self.graph_failures[key] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()
            return None
        entry = (graph, static_in, static_out)
        self._graphs[key] = entry
        return entry

    def _close(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._graph = None
            self._text = None
            if self._torch is not None and self.device.startswith("cuda"):
                self._torch.cuda.empty_cache()
        self._device_bytes = 0
