"""The SDK-served-locally fast paths, on a real event loop: the Batcher's inline run (taken only
when the loop would run a tiny request at once and alone, bounded when the profile lies) and the
HTTP front's repeated headers, whose inputs the data plane's door still checks every time."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
import pytest

from edge_agent import inline_guard
from edge_agent.batching import Batcher
from edge_agent.http_api import EdgeHttpServer
from mesh.client import AsyncClient
from mesh.errors import MeshError
from mesh.types import InferRequest, InferResponse, TaskSignature, TensorSpec, check_inputs
from mesh.v2 import codec as codec
from mesh.v2.body import HEADER_LENGTH

pytestmark = pytest.mark.integration

X = np.ones((1, 64), np.float32)


class _Recorder:
    """An infer function that notes the thread each call ran on and may sleep first."""

    def __init__(self, sleep_s: float = 0.0, fail: bool = False) -> None:
        self.threads: list[int] = []
        self.sleep_s, self.fail = sleep_s, fail

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.threads.append(threading.get_ident())
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.fail:
            raise ValueError("kernel exploded")
        return {"logits": inputs["x"][:, :10] * 2}


@pytest.fixture
async def pool() -> AsyncIterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as ex:
        yield ex


async def test_idle_tiny_request_runs_inline_on_the_loop(pool: ThreadPoolExecutor) -> None:
    rec = _Recorder()
    b = Batcher("tiny", rec, executor=pool, compute_ms=lambda n: 0.01, max_batch=1)
    b.start()
    try:
        res = await b.submit({"x": X}, time.monotonic() + 5)
        np.testing.assert_array_equal(res.outputs["logits"], X[:, :10] * 2)
        assert rec.threads == [threading.get_ident()]
        assert (b.inline_runs, b.batches, b.served, res.batch_rows, res.queue_ms) == (1, 1, 1, 1, 0.0)
    finally:
        await b.stop()


async def test_profile_above_bound_and_stopped_batcher_use_the_executor(pool: ThreadPoolExecutor) -> None:
    rec = _Recorder()
    b = Batcher("big", rec, executor=pool, compute_ms=lambda n: inline_guard.INLINE_MAX_MS * 2, max_batch=1)
    b.start()
    try:
        await b.submit({"x": X}, time.monotonic() + 5)
        assert rec.threads[-1] != threading.get_ident() and b.inline_runs == 0
    finally:
        await b.stop()
    off = Batcher("off", rec, executor=pool, compute_ms=lambda n: 0.01, max_batch=1, inline_max_ms=0.0)
    off.start()
    try:
        await off.submit({"x": X}, time.monotonic() + 5)
        assert rec.threads[-1] != threading.get_ident() and off.inline_runs == 0
    finally:
        await off.stop()


async def test_concurrent_requests_still_batch(pool: ThreadPoolExecutor) -> None:
    """A window opens for companions whenever the loop would hold one: none of these runs inline."""
    rec = _Recorder()
    b = Batcher("win", rec, executor=pool, compute_ms=lambda n: 0.01, max_batch=16, max_window_ms=20)
    b.start()
    try:
        results = await asyncio.gather(*(b.submit({"x": X * i}, time.monotonic() + 5) for i in range(16)))
        for i, r in enumerate(results):
            np.testing.assert_array_equal(r.outputs["logits"], X[:, :10] * 2 * i)
        assert b.inline_runs == 0 and b.batches < 16
    finally:
        await b.stop()


async def test_busy_batcher_queues_instead_of_running_inline(pool: ThreadPoolExecutor) -> None:
    slow = _Recorder(sleep_s=0.05)
    b = Batcher("busy", slow, executor=pool, compute_ms=lambda n: 0.01, max_batch=1, inline_max_ms=0.0)
    b.start()
    try:
        first = asyncio.create_task(b.submit({"x": X}, time.monotonic() + 5))
        await asyncio.sleep(0.01)  # the first batch is now in the executor
        b.inline_max_ms = inline_guard.INLINE_MAX_MS
        second = await b.submit({"x": X}, time.monotonic() + 5)
        await first
        assert b.inline_runs == 0 and second.queue_ms > 0.0
        assert threading.get_ident() not in slow.threads
    finally:
        await b.stop()


async def test_a_profile_that_lies_blocks_the_loop_twice(pool: ThreadPoolExecutor) -> None:
    """The profile says 10 µs, a run takes 40 ms: after a second such run, the executor takes over."""
    rec = _Recorder(sleep_s=inline_guard.INLINE_BLOCK_MS * 2 / 1000.0)
    b = Batcher("liar", rec, executor=pool, compute_ms=lambda n: 0.01, max_batch=1)
    b.start()
    try:
        for _ in range(5):
            await b.submit({"x": X}, time.monotonic() + 5)
        here = threading.get_ident()
        assert rec.threads[:2] == [here, here] and all(t != here for t in rec.threads[2:]), rec.threads
        assert b.inline_runs == 2
    finally:
        await b.stop()


async def test_one_blocking_run_between_fast_ones_keeps_inline_runs(pool: ThreadPoolExecutor) -> None:
    """A preempted thread: one run blocks the loop for 40 ms, the runs around it are fast."""
    rec = _Recorder()
    b = Batcher("preempted", rec, executor=pool, compute_ms=lambda n: 0.01, max_batch=1)
    b.start()
    try:
        for i in range(6):
            rec.sleep_s = inline_guard.INLINE_BLOCK_MS * 2 / 1000.0 if i == 2 else 0.0
            await b.submit({"x": X}, time.monotonic() + 5)
        here = threading.get_ident()
        assert rec.threads == [here] * 6 and b.inline_runs == 6, rec.threads
    finally:
        await b.stop()


async def test_runs_that_are_slow_as_a_rule_turn_inline_off(pool: ThreadPoolExecutor) -> None:
    """Slow runs below the blocking bound: a few are tolerated (preemption), a steady share is not."""
    rec = _Recorder(sleep_s=inline_guard.INLINE_STALL_MS * 3 / 1000.0)
    b = Batcher("sluggish", rec, executor=pool, compute_ms=lambda n: 0.01, max_batch=1)
    b.start()
    try:
        for _ in range(20):
            await b.submit({"x": X}, time.monotonic() + 5)
        here = threading.get_ident()
        inline = [t == here for t in rec.threads]
        assert 1 < b.inline_runs <= 8 and inline[:b.inline_runs] == [True] * b.inline_runs, inline
        assert not any(inline[b.inline_runs:])
    finally:
        await b.stop()


async def test_inline_failure_is_a_mesh_error_and_the_batcher_serves_on(pool: ThreadPoolExecutor) -> None:
    rec = _Recorder(fail=True)
    b = Batcher("broken", rec, executor=pool, compute_ms=lambda n: 0.01, max_batch=1)
    b.start()
    try:
        with pytest.raises(MeshError, match="inference failed: kernel exploded"):
            await b.submit({"x": X}, time.monotonic() + 5)
        rec.fail = False
        ok = await b.submit({"x": X}, time.monotonic() + 5)
        assert ok.outputs["logits"].shape == (1, 10) and b.served == 1
    finally:
        await b.stop()


# ------------------------------------------------------------------ http front


class _ShiftingPlane:
    """One task whose signature can be replaced, answering with the first ten input columns."""

    site = "edge-fast"

    def __init__(self, width: int) -> None:
        self.set_width(width)

    def set_width(self, width: int) -> None:
        self.sig = TaskSignature("t", (TensorSpec("x", "float32", (-1, width)),),
                                 (TensorSpec("y", "float32", (-1, 10)),))

    def task_signature(self, task: str) -> TaskSignature:
        return self.sig

    def tasks(self) -> list[str]:
        return ["t"]

    def ready(self) -> bool:
        return True

    async def infer(self, req: InferRequest) -> InferResponse:
        x = check_inputs(self.sig.inputs, req.inputs)["x"]  # the door's one check
        return InferResponse(req.request_id, {"y": x[:, :10]}, self.site, "v", 0.9, "local_ok",
                             tenant=req.tenant)


async def _post(session: aiohttp.ClientSession, url: str, x: np.ndarray) -> tuple[int, bytes]:
    body, hlen = codec.encode_infer_request({"x": x}, {"latency_ms": 1000.0})
    async with session.post(f"{url}/v2/models/t/infer", data=body,
                            headers={HEADER_LENGTH: str(hlen)}) as resp:
        return resp.status, await resp.read()


async def test_repeated_headers_are_checked_against_the_current_signature() -> None:
    dp = _ShiftingPlane(64)
    async with EdgeHttpServer(dp) as srv, aiohttp.ClientSession() as session:
        for _ in range(3):  # the same header again and again: served
            status, _ = await _post(session, srv.url, X)
            assert status == 200
        dp.set_width(32)
        status, body = await _post(session, srv.url, X)
        assert status == 400 and b"bad_tensor" in body, body
        for _ in range(2):  # a rejected layout stays rejected
            status, _ = await _post(session, srv.url, np.ones((1, 63), np.float32))
            assert status == 400


async def test_sdk_repeated_queries_over_http_keep_their_answers_and_metadata() -> None:
    dp = _ShiftingPlane(64)
    async with EdgeHttpServer(dp) as srv, AsyncClient(srv.url, tenant="acme") as client:
        for i in range(4):
            x = np.full((2, 64), float(i), np.float32)
            r = await client.infer("t", x, latency_ms=500.0)
            np.testing.assert_array_equal(r.output(), x[:, :10])
            assert (r.site, r.variant, r.tenant, r.reason, r.accuracy) == ("edge-fast", "v", "acme", "local_ok", 0.9)
            assert r.request_id and r.output().flags.writeable
