"""The torch-cuda runtime on a real GPU: numerics against ONNX Runtime on the CPU (FP32 tight, FP16
looser), accuracy on the digits holdout, CUDA graphs equal to eager, concurrent callers, and the GPU
hardware class in profiles. Skipped, with the reason, where PyTorch sees no CUDA device.

The text family's FP32 encoder runs too where :func:`bench.gpu_text.find_text_family` finds it
(``TIERMESH_TEXT_FAMILY_DIR``, a copy packed by ``python -m bench.gpu_text pack OUT``, or the local cache)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from variant_store.families.datasets import load_digits_manifest, load_validation_npz
from variant_store.hardware import runtime_support, torch_cuda_available
from variant_store.profiler import profile_variant
from variant_store.runtimes import open_runtime

pytestmark = pytest.mark.gpu

_OK, _WHY = torch_cuda_available()
if not _OK:
    pytest.skip(f"no CUDA GPU for torch: {_WHY}", allow_module_level=True)

MODELS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"
CLASSIFIERS = ["mlp-tiny", "mlp-wide", "cnn-small", "cnn-large"]


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return np.asarray(sess.run(None, {k: v for k, v in feeds.items() if k in names})[0])


@pytest.mark.parametrize("name", CLASSIFIERS)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_digits_match_onnxruntime_and_keep_accuracy(name: str, precision: str) -> None:
    val = load_validation_npz()
    x, y = val.x_holdout, val.y_holdout
    path = MODELS / f"{name}.onnx"
    ref = _ort(path, {"x": x})
    rt = open_runtime("torch-cuda", path, precision=precision)
    rt.load_sync()
    try:
        out = np.concatenate([rt.infer_sync({"x": x[i:i + 64]})["logits"] for i in range(0, len(x), 64)])
        assert not rt.graph_failures  # type: ignore[attr-defined]
    finally:
        rt.unload_sync()
    assert out.dtype == np.float32
    scale = float(np.abs(ref).max())
    err = float(np.abs(out - ref).max())
    assert err <= (1e-2 if precision == "fp16" else 1e-5) * scale, err
    acc, acc_ref = float(np.mean(out.argmax(1) == y)), float(np.mean(ref.argmax(1) == y))
    recorded = next(m["accuracy"] for m in load_digits_manifest()["models"] if m["family"] == name)
    if precision == "fp32":
        assert acc == acc_ref and abs(acc - recorded) < 1e-6
    else:
        assert abs(acc - acc_ref) <= 2 / len(y)  # at most two of 519 images change class


def test_cuda_graphs_equal_eager_and_concurrent_callers_get_their_own_answers() -> None:
    path = MODELS / "cnn-large.onnx"
    x = load_validation_npz().x_holdout
    eager = open_runtime("torch-cuda", path, cuda_graphs=False)
    graphs = open_runtime("torch-cuda", path, cuda_graphs=True)
    eager.load_sync()
    graphs.load_sync()
    try:
        assert graphs.providers_in_use == ["torch-cuda-fp32-graphs"]
        batches = [x[i:i + n] for i, n in zip(range(0, 480, 16), [1, 3, 8, 16] * 8, strict=False)]
        expected = [eager.infer_sync({"x": b})["logits"] for b in batches]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda b: graphs.infer_sync({"x": b})["logits"], batches * 4))
        for want, have in zip(expected * 4, got, strict=True):
            np.testing.assert_allclose(have, want, rtol=0, atol=1e-5)
        assert graphs.device_memory_bytes() > 0
    finally:
        eager.unload_sync()
        graphs.unload_sync()


def test_profile_records_the_gpu_class() -> None:
    val = load_validation_npz()
    res = profile_variant("torch-cuda", MODELS / "cnn-small.onnx", val.x_holdout, val.y_holdout,
                          batch_sizes=(1, 64), repeats=20, time_budget_s=0.5,
                          runtime_options={"precision": "fp16"})
    assert res.hardware_class == f"gpu-{_WHY}" and res.hardware_class.startswith("gpu-")
    assert res.providers == ["torch-cuda-fp16-graphs"] and res.accuracy >= 0.97
    assert set(res.latency) == {1, 64} and res.device_memory_bytes > 0
    assert {r.runtime: r.ok for r in runtime_support()}["torch-cuda"]


def _embed(rt: Any, texts: np.ndarray) -> np.ndarray:
    return np.concatenate([rt.infer_sync({"text": texts[i:i + 64]})["embedding"] for i in range(0, len(texts), 64)])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_text_encoder_takes_text_and_both_heads_keep_their_accuracy(text_family: Path, precision: str) -> None:
    import onnxruntime as ort

    from variant_store.families.text_corpus import Corpus, load_corpus
    from variant_store.runtimes.text import TEXT_SPEC

    x, y = load_corpus().holdout()
    ref_rt = open_runtime("onnx", text_family / "minilm-l6.onnx", intra_op_threads=4)
    ref_rt.load_sync()
    ref = _embed(ref_rt, x)
    ref_rt.unload_sync()
    rt = open_runtime("torch-cuda", text_family / "minilm-l6.onnx", precision=precision)
    rt.load_sync()
    try:
        assert rt.input_specs == [TEXT_SPEC]
        emb = _embed(rt, x)
        assert not rt.graph_failures  # type: ignore[attr-defined]
    finally:
        rt.unload_sync()
    assert emb.dtype == np.float32 and emb.shape == (len(x), 384)
    cos = np.sum(emb * ref, axis=1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(ref, axis=1))
    assert float(cos.min()) >= (0.999 if precision == "fp16" else 0.99999), float(cos.min())
    manifest = json.loads((text_family / "manifest.json").read_text())
    for task, labels in (("text-topic", y), ("text-group", Corpus.group_of(y))):
        head = next(m for m in manifest["models"] if m["task"] == task and m.get("backbone") == "minilm-l6.onnx")
        sess = ort.InferenceSession(str(text_family / head["file"]), providers=["CPUExecutionProvider"])
        acc = float(np.mean(np.asarray(sess.run(None, {"embedding": emb})[0]).argmax(1) == labels))
        assert abs(acc - head["accuracy"]) <= (3 if precision == "fp16" else 1) / len(y), (task, acc)


def test_the_first_load_in_a_process_is_not_charged_the_cuda_context() -> None:
    """In a fresh process (no CUDA context yet), the first torch-cuda variant's measured memory is its own:
    the context and the math libraries (119 MiB of host memory on an H200 before ``_prime``) are set up before
    the measurement. mlp-tiny's file is 50 KB; 48 MiB leaves room for what one variant's own kernels load."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from variant_store.runtimes import open_runtime\n"
            f"p = Path({str(MODELS / 'mlp-tiny.onnx')!r})\n"
            "rt = open_runtime('torch-cuda', p); rt.load_sync(); print(rt.memory_bytes)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    measured = int(out.stdout.split()[-1])
    assert measured < 48 << 20, f"mlp-tiny's first load measured {measured / 2**20:.0f} MiB (the CUDA context?)"
