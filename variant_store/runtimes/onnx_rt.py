"""ONNX Runtime: the CPU provider everywhere, CUDA / TensorRT providers only where a GPU is real.

One intra-op thread per session by default (best on small hosts, and several sessions share a
machine). A session given more never spin-waits between ops: ONNX Runtime's pool spins by default, which
on a serving site takes the cores from the event loop and every other session between two runs (a shared
backbone on two intra-op threads refused queries under load with it, and met its SLO without).
``providers_in_use`` comes from ``session.get_providers()`` after creation, because the GPU build falls
back to the CPU without raising.
"""

from __future__ import annotations

import threading

import numpy as np

from mesh.errors import RuntimeLoadError
from mesh.types import TensorSpec
from variant_store.hardware import onnx_providers
from variant_store.runtimes.base import Runtime
from variant_store.runtimes.text import TEXT_SPEC, text_front

__all__ = ["PRIME_MODEL", "OnnxRuntime"]

# The smallest model ONNX Runtime opens: y = Identity(x), x and y float[1], opset 13, IR 8 (a ModelProto written
# out by hand, so the base install needs no ``onnx`` package). Opening it once is what a process's first session
# pays for ONNX Runtime itself: the import (its shared library's pages), the environment and the CPU kernel
# registry, about 30 MB of RSS in an agent, which the first variant loaded was measured as holding. Measured
# that way, mlp-tiny (a 4.7 KB file) "took" 31.7 MB at a 25 MiB edge and was refused there for good.
PRIME_MODEL = (b'\x08\x08:;\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x05primeZ\x0f\n\x01x\x12\n\n\x08\x08\x01'
               b'\x12\x04\n\x02\x08\x01b\x0f\n\x01y\x12\n\n\x08\x08\x01\x12\x04\n\x02\x08\x01B\x04\n\x00\x10\r')
_primed = False
_prime_lock = threading.Lock()

_ORT_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


def _spec(arg: object) -> TensorSpec:
    name = str(getattr(arg, "name", ""))
    dtype = _ORT_DTYPES.get(str(getattr(arg, "type", "")), str(getattr(arg, "type", "")))
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (getattr(arg, "shape", None) or []))
    return TensorSpec(name=name, dtype=dtype, shape=shape)


class OnnxRuntime(Runtime):
    name = "onnxruntime"

    def _prime(self) -> None:
        """Import ONNX Runtime and open :data:`PRIME_MODEL` once per process, before the first variant's load is
        measured (``Runtime.load_sync``). A failure here is left to the variant's own load to report."""
        global _primed
        with _prime_lock:
            if _primed:
                return
            _primed = True
            try:
                import onnxruntime as ort

                opts = ort.SessionOptions()
                opts.log_severity_level = 3
                sess = ort.InferenceSession(PRIME_MODEL, sess_options=opts, providers=["CPUExecutionProvider"])
                sess.run(None, {"x": np.zeros(1, dtype=np.float32)})
                del sess
            except Exception:  # onnxruntime raises its own untyped errors; the real load says what is wrong
                return

    def _load(self) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise RuntimeLoadError("onnxruntime is not installed") from exc
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.intra_op_threads
        opts.inter_op_num_threads = 1
        if self.intra_op_threads > 1:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.log_severity_level = 3
        providers = self.requested_providers or onnx_providers()
        try:
            sess = ort.InferenceSession(str(self.model_path), sess_options=opts, providers=providers)
        except Exception as exc:  # onnxruntime raises its own untyped Fail / InvalidGraph errors
            raise RuntimeLoadError(f"onnxruntime could not load {self.model_path.name}: {exc}",
                                   path=str(self.model_path)) from exc
        self._sess = sess
        self.providers_in_use = list(sess.get_providers())
        self.input_specs = [_spec(a) for a in sess.get_inputs()]
        self.output_specs = [_spec(a) for a in sess.get_outputs()]
        self._out_names = [s.name for s in self.output_specs]
        # a text model carries its tokenizer: it takes a BYTES tensor and tokenizes it here
        self._text = text_front(sess.get_modelmeta().custom_metadata_map,
                                tuple(s.name for s in self.input_specs))
        if self._text is not None:
            self.input_specs = [TEXT_SPEC]
        # On the CPU alone, call the session's native run directly: the Python wrapper's checks (every input
        # named, no foreign OrtValue, no WebGPU graph capture) repeat what check_inputs guaranteed, and its
        # provider fallback only ever applies to a GPU provider; on a tiny variant they cost a third of the run.
        # One RunOptions is kept: without one the binding builds a default per call. Anything else (a GPU
        # provider, a text model fed by its tokenizer, a binding without ``_sess``) goes through the wrapper.
        native_run = getattr(getattr(sess, "_sess", None), "run", None)
        self._native_run = (native_run if self.providers_in_use == ["CPUExecutionProvider"] and self._text is None
                            and callable(native_run) else None)
        self._run_options = ort.RunOptions()

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # InferenceSession.run is thread-safe, so concurrent batches need no lock here.
        if self._text is not None:
            inputs = self._text.encode(inputs["text"])
        native = self._native_run
        outs = (native(self._out_names, inputs, self._run_options) if native is not None
                else self._sess.run(self._out_names, inputs, self._run_options))
        # tensors come back as arrays already; asarray only for a sequence or map output
        if len(outs) == 1 and type(outs[0]) is np.ndarray:  # one output: no comprehension (a frame of its own)
            return {self._out_names[0]: outs[0]}
        return {n: o if type(o) is np.ndarray else np.asarray(o)
                for n, o in zip(self._out_names, outs, strict=True)}

    def _close(self) -> None:
        self._sess = None  # type: ignore[assignment]
        self._native_run = None
