"""Batcher on a real ONNX Runtime session: concurrent requests are merged, outputs split back right,
and a request that cannot meet its deadline is refused up front."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edge_agent.batching import Batcher
from mesh.errors import MeshError, Overloaded, PayloadTooLarge

pytestmark = pytest.mark.integration


def _linear_model(path: Path) -> None:
    w = np.arange(64 * 10, dtype=np.float32).reshape(64, 10) / 100.0
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"])], "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.flatten())])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)


async def test_concurrent_requests_are_batched(tmp_path: Path) -> None:
    _linear_model(tmp_path / "m.onnx")
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])

    def infer(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": sess.run(None, inputs)[0]}

    with ThreadPoolExecutor(1) as pool:
        b = Batcher("lin", infer, executor=pool, compute_ms=lambda n: 0.05 + 0.01 * n,
                    max_batch=16, max_window_ms=20)
        b.start()
        try:
            rng = np.random.default_rng(0)
            xs = [rng.random((1, 64), dtype=np.float32) for _ in range(16)]
            deadline = time.monotonic() + 5
            results = await asyncio.gather(*(b.submit({"x": x}, deadline) for x in xs))
            for x, r in zip(xs, results, strict=True):
                np.testing.assert_allclose(r.outputs["logits"], sess.run(None, {"x": x})[0], rtol=1e-5)
            assert b.batches < 16  # merged, not one by one
            assert max(r.batch_rows for r in results) > 1
        finally:
            await b.stop()


async def test_refuses_what_cannot_meet_deadline(tmp_path: Path) -> None:
    def slow(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(0.05)
        return {"logits": inputs["x"][:, :10]}

    with ThreadPoolExecutor(1) as pool:
        b = Batcher("slow", slow, executor=pool, compute_ms=lambda n: 50.0, max_batch=1)
        b.start()
        try:
            with pytest.raises(Overloaded):
                await b.submit({"x": np.zeros((1, 64), np.float32)}, time.monotonic() + 0.01)
            ok = await b.submit({"x": np.ones((1, 64), np.float32)}, time.monotonic() + 5)
            assert ok.outputs["logits"].shape == (1, 10)
        finally:
            await b.stop()


async def test_closed_loop_caller_is_not_held_for_the_window(tmp_path: Path) -> None:
    """One caller waiting for each reply: after a few futile windows the batcher stops waiting."""
    def fast(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": inputs["x"][:, :10]}

    with ThreadPoolExecutor(1) as pool:
        b = Batcher("fast", fast, executor=pool, compute_ms=lambda n: 0.01, max_batch=32, max_window_ms=50)
        b.start()
        try:
            times = []
            for _ in range(12):
                t0 = time.perf_counter()
                await b.submit({"x": np.ones((1, 64), np.float32)}, time.monotonic() + 5)
                times.append(time.perf_counter() - t0)
            # the first windows may be held (50 ms each); the last ones must not be
            assert max(times[-5:]) < 0.04, times
        finally:
            await b.stop()


async def test_a_closed_loop_caller_is_probed_ever_more_rarely() -> None:
    """Futile probes double the skip: 3 windows to learn, then one probe after 64, 128, 256 batches (the skip
    fixed at 64 would hold 10 windows over these 500 queries, and three per probe 22)."""
    def fast(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": inputs["x"][:, :10]}

    with ThreadPoolExecutor(1) as pool:
        b = Batcher("fast", fast, executor=pool, compute_ms=lambda n: 0.01, max_batch=32, max_window_ms=50,
                    inline_max_ms=0.0)  # every query through the queue, where windows are held
        b.start()
        try:
            for _ in range(500):
                await b.submit({"x": np.ones((1, 64), np.float32)}, time.monotonic() + 5)
            # at most 6 (fewer only if a stalled machine made the caller's gap outlast the window)
            assert 3 <= b.windows_held <= 6, b.windows_held
        finally:
            await b.stop()


async def test_one_slow_batch_does_not_refuse_tight_requests_for_ever(tmp_path: Path) -> None:
    """A burst of contention makes one batch slow and raises the learnt overhead. Refused requests
    never run, so nothing would bring the estimate down again: it must fade with time instead."""
    calls = 0

    def first_slow(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        nonlocal calls
        calls += 1
        if calls == 1:
            time.sleep(0.3)
        return {"logits": inputs["x"][:, :10]}

    with ThreadPoolExecutor(1) as pool:
        b = Batcher("bursty", first_slow, executor=pool, compute_ms=lambda n: 0.05, max_batch=1)
        b.start()
        try:
            await b.submit({"x": np.ones((1, 64), np.float32)}, time.monotonic() + 5)
            assert b.overhead_ms > 20.0  # learnt from the slow batch
            with pytest.raises(Overloaded):
                await b.submit({"x": np.ones((1, 64), np.float32)}, time.monotonic() + 0.01)
            ok = None
            for _ in range(100):  # bounded: the estimate fades within a few OVERHEAD_DECAY_S
                await asyncio.sleep(0.1)
                try:
                    ok = await b.submit({"x": np.ones((1, 64), np.float32)}, time.monotonic() + 0.01)
                    break
                except Overloaded:
                    continue
            assert ok is not None, f"still refusing tight requests; overhead {b.overhead_ms:.1f} ms"
            assert b.overhead_ms < 10.0
        finally:
            await b.stop()


async def test_submit_to_a_stopped_batcher_is_refused_not_left_hanging() -> None:
    """A request routed to a variant that is unloaded before it queues gets an answer at once."""
    def fast(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": inputs["x"][:, :10]}

    with ThreadPoolExecutor(1) as pool:
        b = Batcher("gone", fast, executor=pool, compute_ms=lambda n: 0.01, max_batch=4)
        b.start()
        await b.stop()
        with pytest.raises(Overloaded, match="not running"):
            await asyncio.wait_for(b.submit({"x": np.ones((1, 64), np.float32)}, time.monotonic() + 5), 2.0)


async def test_a_request_larger_than_the_queue_is_the_callers_error_not_an_overload() -> None:
    def fast(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": inputs["x"][:, :10]}

    with ThreadPoolExecutor(1) as pool:
        b = Batcher("small", fast, executor=pool, compute_ms=lambda n: 0.01, max_batch=4, max_queue_rows=8)
        b.start()
        try:
            with pytest.raises(PayloadTooLarge) as err:
                await b.submit({"x": np.ones((9, 64), np.float32)}, time.monotonic() + 5)
            assert err.value.http_status == 413 and not isinstance(err.value, Overloaded)
            ok = await b.submit({"x": np.ones((8, 64), np.float32)}, time.monotonic() + 5)
            assert ok.outputs["logits"].shape == (8, 10)
        finally:
            await b.stop()


async def test_a_batch_its_executor_refuses_fails_its_requests_and_the_loop_goes_on() -> None:
    """An executor shut down under a running batcher (a site closing) refuses the batch: its requests get an
    error at once instead of hanging, and the batcher still answers once it has an executor again."""
    def fast(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": inputs["x"][:, :10]}

    pool = ThreadPoolExecutor(1)
    b = Batcher("closing", fast, executor=pool, compute_ms=lambda n: 0.01, max_batch=4, inline_max_ms=0.0)
    b.start()
    try:
        pool.shutdown(wait=True)
        with pytest.raises(MeshError, match="inference failed"):
            await asyncio.wait_for(b.submit({"x": np.ones((1, 64), np.float32)}, time.monotonic() + 5), 2.0)
        with ThreadPoolExecutor(1) as again:
            b._executor = again
            ok = await asyncio.wait_for(b.submit({"x": np.ones((1, 64), np.float32)}, time.monotonic() + 5), 2.0)
            assert ok.outputs["logits"].shape == (1, 10)
    finally:
        await b.stop()
