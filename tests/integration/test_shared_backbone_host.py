"""Shared backbones on a real ``VariantHost`` (real ONNX Runtime sessions of the committed digits
backbone and heads): concurrent loads and unloads never open a backbone twice or close it under a
head; queries of different heads share one backbone run; a full site evicts instead of refusing."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_agent.backbone import BackboneBatcher
from edge_agent.host import InstanceKey, VariantHost
from mesh.errors import Overloaded
from tests.helpers_backbone import DIGITS, head_meta, model_meta, seeded_host
from variant_store.runtimes.base import Runtime

pytestmark = pytest.mark.integration
X = (np.random.default_rng(0).random((64, 64)) > 0.5).astype(np.float32)


class CountingHost(VariantHost):
    """The real host, counting backbone opens and noting any open of an instance already open."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.opens: list[InstanceKey] = []
        self.double_opens: list[InstanceKey] = []
        self.base_runtimes: list[Runtime] = []

    async def _open_backbone(self, bkey: InstanceKey, path: Path, max_batch: int):  # type: ignore[no-untyped-def]
        if bkey in self.bases:
            self.double_opens.append(bkey)
        self.opens.append(bkey)
        bb = await super()._open_backbone(bkey, path, max_batch)
        self.base_runtimes.append(bb.runtime)
        return bb


def _check(host: CountingHost) -> None:
    """What must hold whenever nobody is inside a load or unload (the caller holds the host's lock)."""
    for bkey, bb in host.bases.items():
        holders = {k for k, lv in host.instances.items() if lv.base == bkey}
        assert bb.holders == holders and holders, (bkey, bb.holders, holders)
        assert bb.runtime.ready, f"backbone {bkey} closed while held by {holders}"
        assert set(bb.batcher.heads) == {k[0] for k in holders}
    for key, lv in host.instances.items():
        assert lv.runtime.ready, key
        if lv.base is not None:
            assert lv.base in host.bases, f"{key} lost its backbone"
    for rt in host.base_runtimes:
        assert rt.ready == any(b.runtime is rt for b in host.bases.values())
    assert not host.double_opens


def _reference(head_file: str, x: np.ndarray) -> np.ndarray:
    base = ort.InferenceSession(str(DIGITS / "backbone.onnx"), providers=["CPUExecutionProvider"])
    head = ort.InferenceSession(str(DIGITS / head_file), providers=["CPUExecutionProvider"])
    return np.asarray(head.run(None, {"features": base.run(None, {"x": x})[0]})[0])


async def test_concurrent_loads_and_unloads_keep_one_backbone_and_never_close_it_early(tmp_path: Path) -> None:
    host = seeded_host(tmp_path, host_cls=CountingHost)
    assert isinstance(host, CountingHost)
    heads = [head_meta(f"head-{i}.onnx.fp32", "head-digits.onnx" if i % 2 else "head-parity.onnx")
             for i in range(6)]
    pinned = heads[0]
    ref = _reference("head-parity.onnx", X[:1])
    errors: list[BaseException] = []
    rng = random.Random(1)
    stop = asyncio.Event()
    served = 0

    async def query_pinned() -> None:
        nonlocal served
        while not stop.is_set():
            lv = await host.ensure(pinned)
            res = await lv.batcher.submit({"x": X[:1]}, time.monotonic() + 10.0, lane=pinned.variant_id,
                                          tenant="acme")
            np.testing.assert_allclose(res.outputs["logits"], ref, rtol=1e-4, atol=1e-5)
            served += 1
            await asyncio.sleep(0)

    async def churn(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(40):
            # some strict instances, on their own backbone, of only two heads: it drains and reopens
            iso = r.choice(["", "", "globex"])
            meta = r.choice(heads[1:3] if iso else heads[1:])
            op = r.random()
            try:
                if op < 0.45:
                    await host.ensure(meta, iso)
                elif op < 0.85:
                    await host.unload(meta.variant_id, iso)
                else:
                    lv = await host.ensure(meta, iso)
                    await lv.batcher.submit({"x": X[:2]}, time.monotonic() + 10.0, lane=meta.variant_id)
            except Overloaded:
                pass  # a query whose head was unloaded under it is refused, never wrong
            except BaseException as exc:
                errors.append(exc)
            await asyncio.sleep(r.choice([0.0, 0.0, 0.0005, 0.002]))

    async def checker() -> None:
        while not stop.is_set():
            async with host._lock:
                _check(host)
            await asyncio.sleep(0.001)

    try:
        await host.ensure(pinned)
        side = [asyncio.create_task(query_pinned()), asyncio.create_task(checker())]
        try:
            await asyncio.wait_for(asyncio.gather(*(churn(rng.randrange(1 << 30)) for _ in range(8))), 120)
        finally:
            stop.set()
            await asyncio.gather(*side)
        assert not errors, errors[:3]
        async with host._lock:
            _check(host)
        assert served > 0
        # every open had a matching close (or is the one open now): at most one instance per key
        assert len(host.opens) - sum(not rt.ready for rt in host.base_runtimes) == len(host.bases)
        shared_key = (pinned.shared_base_digest or "", "")
        assert shared_key in host.bases and (pinned.variant_id, "") in host.bases[shared_key].holders
        assert len(host.opens) > 2, "the churn never closed and reopened a backbone: not much of a test"
    finally:
        await host.close()
    assert all(not rt.ready for rt in host.base_runtimes)
    assert not host.bases and not host.instances


async def test_heads_of_different_tenants_share_one_backbone_run(tmp_path: Path) -> None:
    host = seeded_host(tmp_path)
    digits, parity = head_meta("head-digits.onnx.fp32"), head_meta("head-parity.onnx.fp32", "head-parity.onnx",
                                                                 task="digit-parity")
    try:
        a = await host.ensure(digits)
        b = await host.ensure(parity)
        assert a.batcher is b.batcher and isinstance(a.batcher, BackboneBatcher)
        assert len(host.bases) == 1
        # the digits backbone and heads take ~0.1 ms a row: alone, each request would run inline (no batch to
        # join; edge_agent.batching); this is about what a batch holds, so every request queues
        a.batcher.inline_max_ms = 0.0
        used = host.memory_used_bytes
        assert used == a.memory_bytes + b.memory_bytes + next(iter(host.bases.values())).runtime.memory_bytes
        deadline = time.monotonic() + 10.0
        calls = [a.batcher.submit({"x": X[i:i + 1]}, deadline, lane=digits.variant_id, tenant="acme")
                 for i in range(8)]
        calls += [b.batcher.submit({"x": X[i:i + 1]}, deadline, lane=parity.variant_id, tenant="initech")
                  for i in range(8, 16)]
        results = await asyncio.gather(*calls)
        want_d, want_p = _reference("head-digits.onnx", X[:8]), _reference("head-parity.onnx", X[8:16])
        for i, r in enumerate(results):
            want = want_d[i] if i < 8 else want_p[i - 8]
            np.testing.assert_allclose(r.outputs["logits"][0], want, rtol=1e-4, atol=1e-5)
            assert r.shared_backbone
        mixed = [m for m in a.batcher.membership if {"acme", "initech"} <= set(m)]
        assert mixed, list(a.batcher.membership)
        assert max(r.tenants for r in results) == 2
        assert host.measured_memory()[digits.variant_id] >= digits.size_bytes
        assert any(k.startswith("base:") for k in host.memory_by_instance())
    finally:
        await host.close()


async def test_a_full_site_evicts_the_least_demanded_idle_variant_instead_of_refusing(tmp_path: Path) -> None:
    host = seeded_host(tmp_path)
    busy, idle, needed = (model_meta("mlp-tiny.onnx.fp32", "mlp-tiny.onnx"),
                          model_meta("cnn-small.onnx.fp32", "cnn-small.onnx"),
                          model_meta("mlp-wide.onnx.fp32", "mlp-wide.onnx"))
    try:
        hot = await host.ensure(busy)
        await host.ensure(idle)
        now = time.monotonic()
        for i in range(50):  # steady demand on one of them; the other loaded last, so LRU alone would keep it
            hot.touch(now + i * 0.01)
        host.instances[(idle.variant_id, "")].last_used = now + 0.6
        # room for neither more nor less than what is loaded now: the wide MLP cannot fit as things are
        host.memory_budget_bytes = host.memory_used_bytes + needed.size_bytes - 1
        lv = await host.ensure(needed)
        assert lv.runtime.ready
        assert (idle.variant_id, "") not in host.instances, "the idle, undemanded variant should have gone"
        assert (busy.variant_id, "") in host.instances
        assert host.evictions == 1
        # a variant that would not fit even were every idle one unloaded: refused, and nothing evicted
        big = model_meta("cnn-large.onnx.fp32", "cnn-large.onnx")
        host.memory_budget_bytes = big.size_bytes - 1
        with pytest.raises(Overloaded, match="would not make room"):
            await host.ensure(big)
        assert host.evictions == 1 and len(host.instances) == 2
    finally:
        await host.close()


@pytest.mark.parametrize("hardware_class", ["cpu", "gpu-test"])
async def test_a_head_on_a_backbone_is_costed_as_timed_here_not_by_its_profile(tmp_path: Path,
                                                                                hardware_class: str) -> None:
    """A head's catalog (or self-measured) profile is its latency *behind* its backbone. The backbone batch's
    cost is the backbone and the head alone, both timed here: adding the profile to the backbone counted the
    backbone twice. Whether the profile is this site's class or another's, a request that profile would call
    10 s long is admitted within 1 s (on a lent H100 the 64-row text requests were refused so)."""
    from variant_store.meta import LatencyStats, Profile

    host = seeded_host(tmp_path)
    host.hardware_class = hardware_class
    slow = Profile(hardware_class=hardware_class, load_ms=1.0, latency={1: LatencyStats(10_000.0, 10_000.0)},
                   peak_memory_bytes=0)
    meta = head_meta("head-digits.onnx.fp32")
    meta = dataclasses.replace(meta, profiles={hardware_class: slow})
    try:
        lv = await host.ensure(meta)
        assert lv.batcher.expected_wait_ms() + lv.batcher._compute_ms(4) < 1000.0
        out = await lv.batcher.submit({"x": X[:4]}, time.monotonic() + 1.0, lane=meta.variant_id)
        assert out.outputs["logits"].shape == (4, 10)
    finally:
        await host.close()
