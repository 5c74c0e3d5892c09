"""A site on a GPU that only PyTorch reaches serves its ONNX variants through ``torch-cuda``: its hardware
class is the GPU's, the host opens a digits variant and the text family's shared encoder with its head on the
GPU, and their batches answer as ONNX Runtime does on the CPU. Skipped, with the reason, elsewhere."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from edge_agent.host import VariantHost
from variant_store.hardware import local_hardware_class, torch_serving
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.gpu

_OK, _WHY = torch_serving()
if not _OK:
    pytest.skip(f"this host does not serve through torch-cuda: {_WHY}", allow_module_level=True)

DIGITS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"


def _meta(variant_id: str, task: str, path: Path, base: Path | None = None) -> VariantMeta:
    data = path.read_bytes()
    return VariantMeta(task=task, family=variant_id.split(".")[0], variant_id=variant_id, format="onnx",
                       precision="fp32", runtime="onnxruntime", blob_digest=hashlib.sha256(data).hexdigest(),
                       size_bytes=len(data), accuracy=0.9,
                       shared_base_digest=None if base is None else hashlib.sha256(base.read_bytes()).hexdigest())


async def _blob_server(files: list[Path]) -> tuple[web.AppRunner, str]:
    blobs = {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in files}

    async def get(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(blobs[request.match_info["digest"]])

    app = web.Application()
    app.router.add_get("/blobs/{digest}", get)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def host(tmp_path: Path) -> AsyncIterator[VariantHost]:
    h = VariantHost("core-gpu", tmp_path / "blobs", hardware_class=local_hardware_class(),
                    memory_budget_bytes=4 << 30)
    try:
        yield h
    finally:
        await h.close()


async def test_a_digits_variant_is_served_on_the_gpu(host: VariantHost) -> None:
    import onnxruntime as ort

    from variant_store.families.datasets import load_validation_npz

    assert host.hardware_class == f"gpu-{_WHY}"
    path = DIGITS / "cnn-large.onnx"
    runner, host.blobs.store_url = await _blob_server([path])
    try:
        meta = _meta("cnn-large.fp32", "digit-classification", path)
        lv = await host.ensure(meta)
        assert lv.runtime.name == "torch-cuda" and lv.runtime.providers_in_use == ["torch-cuda-fp32-graphs"]
        x = load_validation_npz().x_holdout[:37]
        out = await lv.batcher.submit({"x": x}, time.monotonic() + 10, lane=meta.variant_id)
        got = next(iter(out.outputs.values()))
        ref = np.asarray(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0])
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * float(np.abs(ref).max()))
    finally:
        await runner.cleanup()


async def test_the_text_encoder_and_a_head_on_it_are_served_on_the_gpu(host: VariantHost, text_family: Path) -> None:
    import onnxruntime as ort

    from variant_store.families.text_corpus import load_corpus

    enc, head = text_family / "minilm-l6.onnx", text_family / "topic-minilm-l6.onnx"
    runner, host.blobs.store_url = await _blob_server([enc, head])
    try:
        meta = _meta("topic-minilm-l6.fp32", "text-topic", head, enc)
        lv = await host.ensure(meta)
        (bb,) = host.bases.values()
        assert bb.runtime.name == "torch-cuda" and lv.runtime.name == "torch-cuda"
        texts = load_corpus().holdout()[0][:48]
        out = await lv.batcher.submit({"text": texts}, time.monotonic() + 10, lane=meta.variant_id)
        logits = next(iter(out.outputs.values()))
        enc_s = ort.InferenceSession(str(enc), providers=["CPUExecutionProvider"])
        emb = np.asarray(ort.InferenceSession(str(enc), providers=["CPUExecutionProvider"]).run(
            None, _tokens(enc_s, texts))[0])
        ref = np.asarray(ort.InferenceSession(str(head), providers=["CPUExecutionProvider"]).run(
            None, {"embedding": emb})[0])
        assert logits.shape == ref.shape == (48, 10)
        np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-3 * float(np.abs(ref).max()))
    finally:
        await runner.cleanup()


def _tokens(sess: object, texts: np.ndarray) -> dict[str, np.ndarray]:
    from variant_store.runtimes.text import text_front

    meta = sess.get_modelmeta().custom_metadata_map  # type: ignore[attr-defined]
    front = text_front(meta, ("input_ids", "attention_mask"))
    assert front is not None
    return front.encode(texts)
