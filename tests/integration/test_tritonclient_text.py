"""Unmodified ``tritonclient.http`` sends text (``BYTES``, binary and JSON) to the edge's HTTP front, and a
real MiniLM encoder + head (the text family's 2-layer INT8 encoder, tokenizing inside its runtime) answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as tritonhttp

from edge_agent.http_api import EdgeHttpServer
from mesh.errors import UnknownTask
from mesh.types import InferRequest, InferResponse, TaskSignature, Timing, check_inputs
from tests.helpers_dataplane import serve_in_thread
from variant_store.build_text import text_family_dir
from variant_store.families.text_corpus import SECTIONS, load_corpus
from variant_store.runtimes import Runtime, open_runtime

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TASK = "text-topic"


class TextPlane:
    """One site serving one text task: encoder + head, as a site's host composes them."""

    site = "edge-text"

    def __init__(self, encoder: Runtime, head: Runtime) -> None:
        self.encoder, self.head = encoder, head
        self.signature = TaskSignature(TASK, tuple(encoder.input_specs), tuple(head.output_specs))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-dp")

    def task_signature(self, task: str) -> TaskSignature:
        if task != TASK:
            raise UnknownTask(f"no task {task!r}")
        return self.signature

    def tasks(self) -> list[str]:
        return [TASK]

    def ready(self) -> bool:
        return True

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.head.run_checked_sync({"embedding": self.encoder.run_checked_sync(inputs)["embedding"]})

    async def infer(self, req: InferRequest) -> InferResponse:
        t0 = time.perf_counter()
        inputs = check_inputs(self.task_signature(req.task).inputs, req.inputs)
        outputs = await asyncio.get_running_loop().run_in_executor(self._pool, self.run, inputs)
        ms = (time.perf_counter() - t0) * 1000.0
        return InferResponse(req.request_id, outputs, self.site, "topic-minilm-l2-int8.onnx.fp32", 0.69, "local_ok",
                             False, req.tenant, Timing(0.0, 0.0, ms, ms), [*req.hops, self.site])


@pytest.fixture(scope="module")
def plane() -> Iterator[TextPlane]:
    root = text_family_dir()
    enc = open_runtime("onnx", root / "minilm-l2-int8.onnx")
    head = open_runtime("onnx", root / "topic-minilm-l2-int8.onnx")
    enc.load_sync()
    head.load_sync()
    p = TextPlane(enc, head)
    try:
        yield p
    finally:
        p._pool.shutdown(wait=True)
        enc.unload_sync()
        head.unload_sync()


@pytest.fixture(scope="module")
def server(plane: TextPlane) -> Iterator[EdgeHttpServer]:
    with serve_in_thread(plane) as srv:
        yield srv


def test_metadata_says_bytes(server: EdgeHttpServer) -> None:
    c = tritonhttp.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=30.0)
    try:
        meta = c.get_model_metadata(TASK)
    finally:
        c.close()
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]


@pytest.mark.parametrize("binary_in", [True, False])
def test_tritonclient_text_query(server: EdgeHttpServer, plane: TextPlane, binary_in: bool) -> None:
    x, y = load_corpus().holdout()
    x, y = x[:64], y[:64]
    inp = tritonhttp.InferInput("text", [len(x)], "BYTES")
    inp.set_data_from_numpy(x, binary_data=binary_in)
    c = tritonhttp.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=30.0)
    try:
        res = c.infer(TASK, [inp], parameters={"latency_ms": 5000, "min_accuracy": 0.0})
    finally:
        c.close()
    logits = res.as_numpy("logits")
    assert logits is not None and logits.shape == (len(x), len(SECTIONS))
    # what the runtime gives for the same rows in one batch (dynamic INT8 scales per batch: same batch, same answer)
    np.testing.assert_array_equal(logits, plane.run({"text": x})["logits"])
    assert float(np.mean(logits.argmax(axis=1) == y)) > 0.5
