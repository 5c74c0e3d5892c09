"""``VariantHost`` loads over real HTTP and ONNX Runtime: variants that share a blob load at the same
time without tearing each other's download (the ``runtime_load`` seen now and then in a 30 s demo:
the warm floor's backbone and a tenant head's shared base fetched the same digest into one
``.part`` file at once)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from edge_agent.host import VariantHost
from mesh.errors import DeadlineExceeded
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.integration

DIGITS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"


def _meta(variant_id: str, path: Path, base: Path | None = None) -> VariantMeta:
    data = path.read_bytes()
    return VariantMeta(task="digit-classification", family=variant_id.split(".")[0], variant_id=variant_id,
                       format="onnx", precision="fp32", runtime="onnxruntime",
                       blob_digest=hashlib.sha256(data).hexdigest(), size_bytes=len(data), accuracy=0.97,
                       shared_base_digest=None if base is None else hashlib.sha256(base.read_bytes()).hexdigest())


@pytest.fixture
async def slow_store() -> AsyncIterator[str]:
    """Blobs by digest, sent in small chunks with pauses, so that concurrent downloads overlap."""
    blobs = {hashlib.sha256(p.read_bytes()).hexdigest(): p.read_bytes()
             for p in (DIGITS / "backbone.onnx", DIGITS / "head-digits.onnx", DIGITS / "head-parity.onnx")}

    async def get(request: web.Request) -> web.StreamResponse:
        data = blobs[request.match_info["digest"]]
        start = 0
        rng = request.headers.get("Range", "")
        resp = web.StreamResponse(status=206 if rng else 200)
        if rng:
            start = int(rng.removeprefix("bytes=").split("-")[0])
            resp.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        resp.content_length = len(data) - start
        await resp.prepare(request)
        for off in range(start, len(data), 4096):
            await resp.write(data[off:off + 4096])
            await asyncio.sleep(0.002)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/blobs/{digest}", get)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_variants_sharing_a_blob_load_together(tmp_path: Path, slow_store: str) -> None:
    backbone = _meta("backbone.onnx.fp32", DIGITS / "backbone.onnx")
    heads = [_meta("head-digits.onnx.fp32", DIGITS / "head-digits.onnx", DIGITS / "backbone.onnx"),
             _meta("head-parity.onnx.fp32", DIGITS / "head-parity.onnx", DIGITS / "backbone.onnx")]
    host = VariantHost("edge-test", tmp_path / "blobs", hardware_class="cpu", memory_budget_bytes=1 << 30)
    host.blobs.store_url = slow_store
    try:
        loaded = await asyncio.wait_for(asyncio.gather(host.ensure(backbone), *(host.ensure(h) for h in heads)), 60)
        assert [lv.meta.variant_id for lv in loaded] == [backbone.variant_id, *(h.variant_id for h in heads)]
        # one backbone session shared by both heads, and every variant answers
        bkey = (backbone.blob_digest, "")
        assert list(host.bases) == [bkey]
        assert host.bases[bkey].holders == {(h.variant_id, "") for h in heads}
        x = {loaded[0].runtime.input_specs[0].name: np.zeros((2, 64), np.float32)}  # heads take the base's
        for lv in loaded:
            out = await lv.batcher.submit(x, time.monotonic() + 5, lane=lv.meta.variant_id)
            assert next(iter(out.outputs.values())).shape[0] == 2
        assert not list((tmp_path / "blobs").glob("*.part"))
    finally:
        await host.close()


async def test_a_query_waits_for_a_slow_load_only_until_its_deadline(tmp_path: Path, slow_store: str) -> None:
    backbone = _meta("backbone.onnx.fp32", DIGITS / "backbone.onnx")  # ~50 KiB at 4 KiB per 2 ms: ~30 ms
    host = VariantHost("edge-test", tmp_path / "blobs", hardware_class="cpu", memory_budget_bytes=1 << 30)
    host.blobs.store_url = slow_store
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await host.ensure_by(backbone, time.monotonic() + 0.005)
        assert time.monotonic() - t0 < 1.0
        # the load went on: a later query finds it loaded (or joins it)
        lv = await asyncio.wait_for(host.ensure_by(backbone, time.monotonic() + 30), 30)
        assert lv.meta.variant_id == backbone.variant_id and host.cold_starts == 1
    finally:
        await host.close()


async def test_a_settling_host_frees_an_unloaded_variant(tmp_path: Path, slow_store: str) -> None:
    """With ``settle_heap`` (as an agent runs it) loads freeze the heap; after an unload the host owes a thaw and
    pays it once it has been quiet, so the unloaded variant's runtime and batcher (reference cycles: a batcher's
    task holds the batcher) are freed."""
    import gc
    import weakref

    host = VariantHost("s", tmp_path / "cache", hardware_class="cpu", memory_budget_bytes=1 << 30,
                       settle_heap=True)
    host.blobs.store_url = slow_store
    assert host.settler is not None
    host.settler.quiet_s = 0.1
    try:
        assert not host.settling
        loading = asyncio.ensure_future(host.ensure(_meta("digits.full", DIGITS / "head-digits.onnx")))
        await asyncio.sleep(0)
        assert host.settling  # a load under way: what `tiermesh up` waits for (Readiness.wait_quiet)
        lv = await loading
        assert gc.get_freeze_count() > 0 and not host.settling
        refs = [weakref.ref(lv.runtime), weakref.ref(lv.batcher)]
        del lv, loading  # the future holds its result
        await host.unload("digits.full")
        assert host.settler.owed and host.settling  # the thaw it owes blocks the loop: still settling
        await asyncio.sleep(0.5)  # quiet past quiet_s: the owed thaw ran
        assert not host.settler.owed and host.settler.thaws == 1 and not host.settling
        assert [r() for r in refs] == [None, None]
    finally:
        await host.close()
        gc.unfreeze()


async def test_a_variant_the_gpu_runtime_refuses_is_served_on_the_cpu(tmp_path: Path, slow_store: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch-served GPU site an ONNX variant opens with ``torch-cuda``; where that refuses it (here: no
    GPU at all, as an unsupported op would), the site serves it with ONNX Runtime instead of failing."""
    import edge_agent.host as host_mod

    asked: list[str] = []

    def serving(fmt: str) -> str:
        asked.append(fmt)
        return "torch-cuda"

    monkeypatch.setattr(host_mod, "serving_runtime", serving)
    host = VariantHost("core-test", tmp_path / "blobs", hardware_class="gpu-h100", memory_budget_bytes=1 << 30)
    host.blobs.store_url = slow_store
    try:
        lv = await asyncio.wait_for(host.ensure(_meta("digits.full", DIGITS / "head-digits.onnx")), 60)
        assert asked == ["onnx"] and lv.runtime.name == "onnxruntime"
        out = await lv.batcher.submit({lv.runtime.input_specs[0].name: np.zeros((3, 64), np.float32)},
                                      time.monotonic() + 5, lane=lv.meta.variant_id)
        assert next(iter(out.outputs.values())).shape[0] == 3
    finally:
        await host.close()
