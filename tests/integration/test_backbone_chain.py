"""A backbone under load takes its next batch on the executor thread that finished the last one
(``BackboneBatcher._chain``), with real ONNX Runtime sessions of the committed digits backbone and heads
on a real ``VariantHost``: every request still gets its own head's rows; a run of batches stops when the
batcher stops or a head goes, and nobody's request is lost or run on a closed session."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_agent.backbone import BackboneBatcher
from edge_agent.batch_parts import BatchResult
from edge_agent.host import LoadedVariant, VariantHost
from mesh.errors import MeshError, Overloaded
from tests.helpers_backbone import DIGITS, head_meta, seeded_host

pytestmark = pytest.mark.integration
X = (np.random.default_rng(7).random((1024, 64)) > 0.5).astype(np.float32)
DIGITS_HEAD = head_meta("head-digits.onnx.fp32")
PARITY_HEAD = head_meta("head-parity.onnx.fp32", "head-parity.onnx", task="digit-parity")


def _reference(head_file: str, x: np.ndarray) -> np.ndarray:
    base = ort.InferenceSession(str(DIGITS / "backbone.onnx"), providers=["CPUExecutionProvider"])
    head = ort.InferenceSession(str(DIGITS / head_file), providers=["CPUExecutionProvider"])
    return np.asarray(head.run(None, {"features": base.run(None, {"x": x})[0]})[0])


async def _two_heads(host: VariantHost) -> tuple[BackboneBatcher, LoadedVariant]:
    """The digits and parity heads loaded on ``host``: their one backbone batcher (every request queued: the digits
    models are tiny, and alone a request would run inline) and the parity head's instance."""
    bb = (await host.ensure(DIGITS_HEAD)).batcher
    parity = await host.ensure(PARITY_HEAD)
    assert isinstance(bb, BackboneBatcher) and parity.batcher is bb
    bb.inline_max_ms = 0.0
    return bb, parity


def _burst(bb: BackboneBatcher, n: int) -> list[asyncio.Task[BatchResult]]:
    """``n`` one-row requests queued at once, even rows to the digits head (tenant acme), odd to parity (initech)."""
    deadline = time.monotonic() + 30.0
    return [asyncio.ensure_future(bb.submit({"x": X[i % len(X)][None, :]}, deadline,
                                            lane=(DIGITS_HEAD if i % 2 == 0 else PARITY_HEAD).variant_id,
                                            tenant="acme" if i % 2 == 0 else "initech"))
            for i in range(n)]


async def test_a_loaded_backbone_runs_its_next_batches_without_handing_them_to_the_loop(tmp_path: Path) -> None:
    host = seeded_host(tmp_path)
    try:
        bb, _ = await _two_heads(host)
        want_d, want_p = _reference("head-digits.onnx", X[0::2]), _reference("head-parity.onnx", X[1::2])
        for chain_max_s, chained in ((0.0, False), (60.0, True)):
            bb.chain_max_s, bb.chained, batches = chain_max_s, 0, bb.batches
            results = await asyncio.gather(*_burst(bb, len(X)))
            # 1024 rows in batches of at most 64 (32 per head): after the first, each batch was queued in full
            # when the one before it ended, so every later batch was taken on the executor thread
            assert bb.batches - batches >= len(X) // bb.max_batch
            assert (bb.chained >= len(X) // bb.max_batch - 1) if chained else bb.chained == 0
            for i, r in enumerate(results):  # each request got its own head's rows
                want = want_d[i // 2] if i % 2 == 0 else want_p[i // 2]
                np.testing.assert_allclose(r.outputs["logits"][0], want, rtol=1e-4, atol=1e-5)
                assert r.shared_backbone
            assert any({"acme", "initech"} <= set(m) for m in bb.membership)
        if bb._running:  # the last answers can come before the run that gave them has ended
            await asyncio.wait(set(bb._running), timeout=10.0)
        assert bb._queued_rows == 0 and not bb._queue and not bb._ends  # the books balance once it is idle
    finally:
        await host.close()


async def test_stopping_a_backbone_while_it_runs_batches_itself_answers_every_request(tmp_path: Path) -> None:
    host = seeded_host(tmp_path)
    try:
        bb, _ = await _two_heads(host)
        calls = _burst(bb, 4000)
        await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await asyncio.wait_for(host.close(), 30.0)
    done, pending = await asyncio.wait(calls, timeout=10.0)
    assert not pending, f"{len(pending)} requests never answered"
    errors = [c.exception() for c in done if c.exception() is not None]
    assert all(isinstance(e, Overloaded) for e in errors), {type(e).__name__ for e in errors}
    assert len(errors) < len(calls), "nothing was served before the stop: not much of a test"


async def test_a_head_removed_under_load_never_runs_on_its_closed_session(tmp_path: Path) -> None:
    """Requests keep coming while the parity head is unloaded. Its session closes only once the batch that is
    inside it has left (held there by the test); its later rows are refused (``Overloaded``), never run on the
    closed session; the digits head's requests are all served."""
    host = seeded_host(tmp_path)
    try:
        bb, parity = await _two_heads(host)
        run, inside, leave = parity.runtime._run, threading.Event(), threading.Event()

        def held_run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            if not inside.is_set():  # the first parity batch waits in the head until the test lets it go
                inside.set()
                leave.wait(10.0)
            return run(inputs)

        parity.runtime._run = held_run  # type: ignore[method-assign]
        calls = _burst(bb, 400)
        assert await asyncio.get_running_loop().run_in_executor(None, inside.wait, 10.0)
        unloading = asyncio.ensure_future(host.unload(PARITY_HEAD.variant_id))
        for _ in range(20):  # bounded: more requests while the unload waits
            calls += _burst(bb, 50)
            await asyncio.sleep(0.005)
        assert parity.runtime.ready, "the head's session closed while a batch was inside it"
        leave.set()
        await asyncio.wait_for(unloading, 10.0)
        assert not parity.runtime.ready
        calls += _burst(bb, 200)
        _, pending = await asyncio.wait(calls, timeout=30.0)
        assert not pending
        for i, c in enumerate(calls):
            if i % 2 == 0:  # digits: always served
                assert c.exception() is None, c.exception()
            elif c.exception() is not None:
                assert isinstance(c.exception(), Overloaded), c.exception()
        assert sum(c.exception() is not None for c in calls[1::2]) > 0, "no parity request came after the unload"
        assert bb.chained > 0, "no batch was taken on the executor thread: not much of a test"
    finally:
        await host.close()


async def test_a_backbone_batch_its_executor_refuses_fails_and_gives_its_slot_back(tmp_path: Path) -> None:
    host = seeded_host(tmp_path)
    try:
        bb, _ = await _two_heads(host)
        executor = bb._executor
        with ThreadPoolExecutor(1) as closed:
            pass
        bb._executor = closed
        with pytest.raises(MeshError, match="inference failed"):
            await asyncio.wait_for(asyncio.gather(*_burst(bb, 4)), 5.0)
        assert not bb._ends
        bb._executor = executor  # the slot came back: the next batch runs
        results = await asyncio.wait_for(asyncio.gather(*_burst(bb, 4)), 5.0)
        assert [r.outputs["logits"].shape[1] for r in results] == [10, 2, 10, 2]
    finally:
        await host.close()
