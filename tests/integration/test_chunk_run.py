"""``edge_agent.chunk_run`` on real ONNX Runtime sessions loaded by a real ``VariantHost``: a head on a shared
backbone answers a chunk's rows exactly as the online path (``BackboneBatcher.infer_for``) does, a plain variant as
its session does; online work in flight holds the next batch back, and a lost lease stops the run.

The text batching rule (a pure function) is checked as a table."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_agent.backbone import BackboneBatcher
from edge_agent.chunk_run import TEXT_BATCH_ROWS, ChunkRun, batches, feed, run_rows
from mesh.errors import ConflictError
from tests.helpers_backbone import DIGITS, head_meta, model_meta, seeded_host
from variant_store.families.datasets import load_validation_npz

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("rows", "batch_rows", "text", "want"), [
    (10, 3, False, [(0, 3), (3, 6), (6, 9), (9, 10)]),
    (600, 256, False, [(0, 256), (256, 512), (512, 600)]),
    (70, 256, True, [(0, TEXT_BATCH_ROWS), (TEXT_BATCH_ROWS, 2 * TEXT_BATCH_ROWS), (2 * TEXT_BATCH_ROWS, 70)]),
    (5, 2, True, [(0, 2), (2, 4), (4, 5)]),
])
def test_batches(rows: int, batch_rows: int, text: bool, want: list[tuple[int, int]]) -> None:
    assert batches(rows, batch_rows, text) == want


async def test_a_head_runs_on_its_backbone_as_online_does(tmp_path: Path) -> None:
    x = load_validation_npz().x[:300]
    host = seeded_host(tmp_path)
    try:
        head = await host.ensure(head_meta("head-digits.onnx.fp32"))
        plain = await host.ensure(model_meta("mlp-tiny.onnx.fp32", "mlp-tiny.onnx"))
        assert head.base is not None and plain.base is None
        base = host.bases[head.base].runtime
        tally = ChunkRun()
        out = await run_rows(x, feed(head.runtime, "x", base), batch_rows=128, online_busy=lambda: False,
                             lease_alive=lambda: True, pause_s=0.001, what="chunk 0", tally=tally)
        assert tally.batch_sizes == [128, 128, 44] and tally.compute_s > 0
        assert isinstance(head.batcher, BackboneBatcher)
        online = head.batcher.infer_for("head-digits.onnx.fp32")
        want = np.concatenate([online({"x": x[lo:hi]})["logits"] for lo, hi in batches(300, 128, False)])
        np.testing.assert_allclose(out["logits"], want, rtol=1e-5, atol=1e-5)
        # the same as the two files run by hand, backbone then head
        bb = ort.InferenceSession(str(DIGITS / "backbone.onnx"), providers=["CPUExecutionProvider"])
        hd = ort.InferenceSession(str(DIGITS / "head-digits.onnx"), providers=["CPUExecutionProvider"])
        by_hand = hd.run(None, {hd.get_inputs()[0].name: bb.run(None, {"x": x})[0]})[0]
        np.testing.assert_allclose(out["logits"], by_hand, rtol=1e-4, atol=1e-4)
        # a plain variant: its own session
        mlp = ort.InferenceSession(str(DIGITS / "mlp-tiny.onnx"), providers=["CPUExecutionProvider"])
        out2 = await run_rows(x, feed(plain.runtime, "x"), batch_rows=256, online_busy=lambda: False,
                              lease_alive=lambda: True, pause_s=0.001, what="chunk 1", tally=ChunkRun())
        np.testing.assert_allclose(out2["logits"], mlp.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)

        # online in flight: no batch runs until it passes; then a lease lost between batches stops the run
        busy, alive, calls = [True], [True], [0]
        inner = feed(plain.runtime, "x")

        async def counted(rows: np.ndarray) -> dict[str, np.ndarray]:
            calls[0] += 1
            if calls[0] == 2:
                alive[0] = False  # lost while the second batch runs
            return await inner(rows)

        tally = ChunkRun()
        run = asyncio.create_task(run_rows(x, counted, batch_rows=100, online_busy=lambda: busy[0],
                                           lease_alive=lambda: alive[0], pause_s=0.005, what="chunk 7 of job j",
                                           tally=tally))
        await asyncio.sleep(0.1)
        assert calls[0] == 0 and not run.done()
        busy[0] = False
        with pytest.raises(ConflictError, match="lease lost mid-chunk 7 of job j"):
            await asyncio.wait_for(run, 10)
        assert calls[0] == 2 and tally.paused_s >= 0.05
    finally:
        await host.close()
