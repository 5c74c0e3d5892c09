"""A real ``DataPlane`` for tests of the HTTP front and the SDK: one ONNX model, run by onnxruntime.

It is not a fake: inputs are validated against the signature the model declares, inference runs
in an executor, and the SLO is honoured as far as one variant can (``prefer="refuse"`` with an
accuracy it cannot reach raises ``ImpossibleSLO``; otherwise it serves best effort and says so).

The model is ``variant_store/models/digits/mlp-tiny.onnx`` when present; otherwise the MLP that
``tests.helpers_models`` trains with scikit-learn on the bundled digits set.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edge_agent.dataplane import DataPlane
from edge_agent.http_api import EdgeHttpServer
from mesh.errors import DeadlineExceeded, ImpossibleSLO, UnknownTask, UnknownTenant
from mesh.types import InferRequest, InferResponse, TaskSignature, TensorSpec, Timing, check_inputs
from tests.helpers_models import trained_mlp_onnx

__all__ = ["COMMITTED_MODEL", "OnnxDataPlane", "digits_model", "serve_in_thread"]

COMMITTED_MODEL = Path(__file__).resolve().parents[1] / "variant_store/models/digits/mlp-tiny.onnx"
_ORT_TO_NP = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(int64)": "int64",
              "tensor(int32)": "int32", "tensor(float16)": "float16", "tensor(uint8)": "uint8"}


def digits_model(workdir: Path) -> Path:
    """The committed tiny MLP if another part of the project has produced it, else a fresh one."""
    if COMMITTED_MODEL.exists():
        return COMMITTED_MODEL
    path = workdir / "mlp-digits.onnx"
    return path if path.exists() else trained_mlp_onnx(path)


def _spec(arg: ort.NodeArg) -> TensorSpec:
    dtype = _ORT_TO_NP.get(arg.type)
    if dtype is None:
        raise ValueError(f"unsupported ONNX type {arg.type} for {arg.name}")
    shape = tuple(d if isinstance(d, int) else -1 for d in arg.shape)
    return TensorSpec(arg.name, dtype, shape)


class OnnxDataPlane:
    """One site, one task, one variant: a real ONNX model served by onnxruntime."""

    def __init__(self, site: str = "edge-test", model_path: Path | str = COMMITTED_MODEL, *,
                 task: str = "digit-classification", accuracy: float = 0.95,
                 tenants: frozenset[str] | None = None, is_ready: bool = True) -> None:
        self.site = site
        self.task = task
        self.accuracy = accuracy
        self.tenants = tenants
        self.is_ready = is_ready
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
        self.variant = f"{Path(model_path).stem}.onnx.fp32"
        self.signature = TaskSignature(task, tuple(_spec(a) for a in self.session.get_inputs()),
                                       tuple(_spec(a) for a in self.session.get_outputs()))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onnx-dp")
        self.calls = 0

    def task_signature(self, task: str) -> TaskSignature:
        if task != self.task:
            raise UnknownTask(f"no task {task!r}")
        return self.signature

    def tasks(self) -> list[str]:
        return [self.task]

    def ready(self) -> bool:
        return self.is_ready

    def run_direct(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """onnxruntime's own answer, bypassing every transport: the reference for tests."""
        names = [o.name for o in self.signature.outputs]
        return dict(zip(names, self.session.run(names, inputs), strict=True))

    async def infer(self, req: InferRequest) -> InferResponse:
        t0 = time.perf_counter()
        self.task_signature(req.task)
        if self.tenants is not None and req.tenant not in self.tenants:
            raise UnknownTenant(f"tenant {req.tenant!r} is not known")
        req.inputs = check_inputs(self.signature.inputs, req.inputs)  # the door's one check
        short = req.slo.min_accuracy > self.accuracy
        if short and req.slo.prefer == "refuse":
            raise ImpossibleSLO(f"no variant of {req.task} reaches accuracy {req.slo.min_accuracy}")
        if req.deadline and req.remaining_ms() <= 0:
            raise DeadlineExceeded(f"request {req.request_id} arrived after its deadline")
        loop = asyncio.get_running_loop()
        t1 = time.perf_counter()
        outputs = await loop.run_in_executor(self._pool, self.run_direct, req.inputs)
        t2 = time.perf_counter()
        self.calls += 1
        return InferResponse(
            request_id=req.request_id, outputs=outputs, site=self.site, variant=self.variant,
            accuracy=self.accuracy, reason="best_effort_accuracy" if short else "local_ok",
            best_effort=short, tenant=req.tenant,
            timing=Timing(network_ms=0.0, queue_ms=(t1 - t0) * 1000.0, compute_ms=(t2 - t1) * 1000.0,
                          total_ms=(t2 - t0) * 1000.0),
            hops=[*req.hops, self.site])

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@contextmanager
def digits_plane(workdir: Path, site: str, **kwargs: Any) -> Iterator[OnnxDataPlane]:
    """An :class:`OnnxDataPlane` at ``site`` on the trained digits MLP (written to ``workdir``), closed on exit."""
    plane = OnnxDataPlane(site, digits_model(workdir), **kwargs)
    try:
        yield plane
    finally:
        plane.close()


@contextmanager
def serve_in_thread(dp: DataPlane, **server_kwargs: Any) -> Iterator[EdgeHttpServer]:
    """Run an ``EdgeHttpServer`` on its own loop thread, for blocking clients (tritonclient, the sync
    SDK) that would otherwise deadlock a test's event loop. Stopped and joined even on failure."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="edge-http-test", daemon=True)
    thread.start()
    server = EdgeHttpServer(dp, **server_kwargs)
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
        yield server
    finally:
        try:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            loop.close()
