"""How big a shared backbone's batches get, and what it expects them to cost (real ONNX Runtime
sessions of the committed digits backbone and heads on a real ``VariantHost``): a backbone's batch
holds a full batch of every head on it (up to its cap), so rows of several heads' tenants go through
one backbone run beyond one head's batch size; its admission counts the batches it runs at once."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edge_agent.backbone import BATCH_CAP, BackboneBatcher, _piecewise, measure_compute_ms
from tests.helpers_backbone import DIGITS, head_meta, seeded_host
from variant_store.runtimes import open_runtime

pytestmark = pytest.mark.integration
X = (np.random.default_rng(3).random((256, 64)) > 0.5).astype(np.float32)


def _heads(n: int, batch: int) -> list:  # type: ignore[type-arg]
    files = ("head-digits.onnx", "head-parity.onnx")
    return [replace(head_meta(f"h{i}.onnx.fp32", files[i % 2], task=f"task-{i}"), batch_sizes=[1, batch])
            for i in range(n)]


async def test_a_backbone_batch_holds_a_full_batch_of_every_head_up_to_its_cap(tmp_path: Path) -> None:
    host = seeded_host(tmp_path)
    heads = _heads(4, 16)
    try:
        lvs = [await host.ensure(m) for m in heads]
        bb = lvs[0].batcher
        assert isinstance(bb, BackboneBatcher)
        assert bb.max_batch == 4 * 16
        await host.unload(heads[3].variant_id)
        assert bb.max_batch == 3 * 16
        bb.inline_max_ms = 0.0  # tiny models would run inline, alone, when nothing is queued: this is about batches
        # 96 one-row requests of three tenants queued at once: batches span tenants and exceed one head's 16
        deadline = time.monotonic() + 20.0
        calls = [bb.submit({"x": X[i:i + 1]}, deadline, lane=heads[i % 3].variant_id, tenant=f"t{i % 3}")
                 for i in range(96)]
        results = await asyncio.gather(*calls)
        assert all(r.shared_backbone for r in results)
        assert max(r.batch_rows for r in results) > 16
        assert max(r.batch_rows for r in results) <= 48
        assert max(len(m) for m in bb.membership) > 16
        for i, r in enumerate(results):  # each request got its own head's rows back
            assert r.outputs["logits"].shape == (1, 10 if (i % 3) % 2 == 0 else 2)
        many = _heads(12, 32)
        for m in many[4:]:
            await host.ensure(m)
        assert bb.max_batch == BATCH_CAP
    finally:
        await host.close()


async def test_a_site_runs_its_backbone_one_batch_at_a_time_on_all_its_threads(tmp_path: Path) -> None:
    host = seeded_host(tmp_path)
    try:
        lv = await host.ensure(_heads(1, 32)[0])
        bb = lv.batcher
        assert isinstance(bb, BackboneBatcher) and bb.parallel == 1
        base = next(iter(host.bases.values())).runtime
        assert base.intra_op_threads == host.threads == 2
        assert lv.runtime.intra_op_threads == 1  # a head is small: one thread, inside the backbone's batch
        bb._queued_rows = 4 * bb.max_batch  # as if four full batches were queued: drained one at a time
        assert bb.expected_wait_ms() == pytest.approx(4 * bb._compute_ms(bb.max_batch), rel=1e-6)
        bb._queued_rows = 0
    finally:
        await host.close()


async def test_admission_counts_the_batches_a_backbone_runs_at_once(tmp_path: Path) -> None:
    base = open_runtime("onnx", DIGITS / "backbone.onnx", intra_op_threads=1)
    await base.load()
    bb = BackboneBatcher("bb", base, executor=None, compute_ms=lambda n: 1.0 + 0.1 * n, max_batch=32, parallel=2)
    try:
        bb._queued_rows = 4 * bb.max_batch  # four full batches queued, drained two at a time
        assert bb.expected_wait_ms() == pytest.approx(2 * bb._compute_ms(bb.max_batch), rel=1e-6)
    finally:
        bb._queued_rows = 0
        await base.unload()


def test_the_cost_model_interpolates_between_timed_sizes_and_never_falls() -> None:
    cost = _piecewise([1, 32, 128], [1.0, 7.0, 16.0])
    assert cost(1) == pytest.approx(1.0)
    assert cost(32) == pytest.approx(7.0)
    assert cost(64) == pytest.approx(7.0 + 9.0 * 32 / 96)
    assert cost(256) == pytest.approx(16.0 + 9.0 / 96 * 128)
    noisy = _piecewise([1, 32, 128], [1.0, 9.0, 8.0])  # a noisy timing never makes more rows cheaper
    assert noisy(128) >= noisy(32)


def test_measuring_a_backbone_times_it_at_several_sizes(tmp_path: Path) -> None:
    from tests.helpers_backbone import DIGITS
    from variant_store.runtimes import open_runtime

    rt = open_runtime("onnx", DIGITS / "backbone.onnx", intra_op_threads=1)
    rt.load_sync()
    try:
        cost = measure_compute_ms(rt, repeats=3)
        assert 0.0 < cost(1) <= cost(32) <= cost(128)
    finally:
        rt.unload_sync()
