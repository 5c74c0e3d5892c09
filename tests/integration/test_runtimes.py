"""Runtimes against real models: ONNX Runtime and TFLite (int8 written by our writer)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mesh.errors import BadTensor, RuntimeLoadError
from tests.helpers_models import digits_split, trained_mlp_onnx
from variant_store.generate.tflite_writer import write_tflite_int8
from variant_store.runtimes import OnnxRuntime, TFLiteRuntime, open_runtime
from variant_store.runtimes.tensorrt_rt import TensorRTRuntime, available

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rt")
    onnx_path = trained_mlp_onnx(root / "mlp.onnx")
    tfl = write_tflite_int8(onnx_path, digits_split().x_train[:256], root / "mlp.tflite")
    return {"onnx": onnx_path, "tflite": tfl}


@pytest.mark.parametrize("fmt", ["onnx", "tflite"])
async def test_load_infer_unload(models: dict[str, Path], fmt: str) -> None:
    rt = open_runtime(fmt, models[fmt])
    assert isinstance(rt, OnnxRuntime if fmt == "onnx" else TFLiteRuntime)
    assert not rt.ready
    assert await rt.load() is True
    try:
        assert rt.ready and rt.memory_bytes >= models[fmt].stat().st_size
        assert [(s.name, s.dtype, s.shape) for s in rt.input_specs] == [("x", "float32", (-1, 64))]
        assert [(s.name, s.shape) for s in rt.output_specs] == [("logits", (-1, 10))]
        if fmt == "onnx":
            assert rt.providers_in_use == ["CPUExecutionProvider"]
        split = digits_split()
        for n in (1, 7, 32, 1):  # batch resizes both ways
            out = (await rt.infer({"x": split.x_val[:n]}))["logits"]
            assert out.shape == (n, 10) and out.dtype == np.float32
        full = rt.infer_sync({"x": split.x_val})["logits"]
        assert np.mean(full.argmax(1) == split.y_val) > 0.93
        # The same row gives the same logits whatever batch it rides in.
        np.testing.assert_allclose(rt.infer_sync({"x": split.x_val[3:4]})["logits"][0], full[3],
                                   rtol=1e-5, atol=1e-5)
    finally:
        await rt.unload()
    assert not rt.ready and rt.memory_bytes == 0
    with pytest.raises(RuntimeLoadError, match="not loaded"):
        rt.infer_sync({"x": digits_split().x_val[:1]})


@pytest.mark.parametrize("fmt", ["onnx", "tflite"])
def test_bad_tensors_are_rejected_naming_the_tensor(models: dict[str, Path], fmt: str) -> None:
    rt = open_runtime(fmt, models[fmt])
    rt.load_sync()
    try:
        x = digits_split().x_val[:4]
        with pytest.raises(BadTensor, match=r"'x'.*float32.*float64"):
            rt.infer_sync({"x": x.astype(np.float64)})
        with pytest.raises(BadTensor, match=r"'x'.*\(N, 64\).*\(4, 63\)"):
            rt.infer_sync({"x": x[:, :63]})
        with pytest.raises(BadTensor, match="'x'"):
            rt.infer_sync({"x": x.reshape(4, 8, 8)})
        with pytest.raises(BadTensor, match="missing"):
            rt.infer_sync({"pixels": x})
        with pytest.raises(BadTensor, match="unknown"):
            rt.infer_sync({"x": x, "extra": x})
        with pytest.raises(BadTensor) as info:
            rt.infer_sync({"x": x[:0]})
        assert info.value.code == "bad_tensor" and info.value.http_status == 400
    finally:
        rt.unload_sync()


@pytest.mark.parametrize("fmt", ["onnx", "tflite"])
def test_load_failures_are_runtime_load_errors(tmp_path: Path, fmt: str) -> None:
    with pytest.raises(RuntimeLoadError, match="not found"):
        open_runtime(fmt, tmp_path / "absent.bin").load_sync()
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00not a model" * 50)
    with pytest.raises(RuntimeLoadError):
        open_runtime(fmt, junk).load_sync()
    with pytest.raises(RuntimeLoadError, match="no runtime"):
        open_runtime("pickle", junk)


class _ThreadRecordingOnnx(OnnxRuntime):
    """The real ONNX runtime, noting which thread ran each inference."""

    threads: list[int]

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.threads.append(threading.get_ident())
        return super()._run(inputs)


async def test_inference_runs_off_the_event_loop(models: dict[str, Path]) -> None:
    rt = _ThreadRecordingOnnx(models["onnx"])
    rt.threads = []
    await rt.load()
    try:
        big = np.ascontiguousarray(np.resize(digits_split().x_val, (150_000, 64)))
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                await asyncio.sleep(0.002)
                ticks += 1

        task = asyncio.create_task(ticker())
        try:
            t0 = time.perf_counter()
            for _ in range(3):
                out = await asyncio.wait_for(rt.infer({"x": big}), timeout=60)
            busy = time.perf_counter() - t0
        finally:
            stop.set()
            await task
        assert out["logits"].shape == (150_000, 10)
        assert rt.threads and threading.get_ident() not in rt.threads
        # The loop kept turning while the inferences ran (at least a few ticks per 100 ms of work).
        assert ticks >= 3 and ticks >= int(busy / 0.1)
    finally:
        await rt.unload()


@pytest.mark.gpu
def test_tensorrt_runtime(models: dict[str, Path]) -> None:
    ok, why = available()
    if not ok:
        pytest.skip(f"TensorRT unavailable: {why}")
    rt = TensorRTRuntime(models["onnx"])
    rt.load_sync()
    try:
        out = rt.infer_sync({"x": digits_split().x_val[:8]})["logits"]
        assert out.shape == (8, 10)
    finally:
        rt.unload_sync()


def test_tensorrt_refuses_to_load_without_it(models: dict[str, Path]) -> None:
    ok, why = available()
    if ok:
        pytest.skip("TensorRT is available here")
    with pytest.raises(RuntimeLoadError, match="tensorrt unavailable"):
        open_runtime("tensorrt", models["onnx"]).load_sync()
    assert why


@pytest.mark.parametrize("threads", [1, 2])
def test_an_onnx_session_with_a_pool_never_spins(models: dict[str, Path], threads: int) -> None:
    """A session on several intra-op threads turns ONNX Runtime's spin-wait off (it took the event loop's core
    between runs); one on one thread has no pool to spin."""
    rt = OnnxRuntime(models["onnx"], intra_op_threads=threads)
    rt.load_sync()
    try:
        opts = rt._sess.get_session_options()
        assert opts.intra_op_num_threads == threads
        spin = opts.get_session_config_entry("session.intra_op.allow_spinning") if threads > 1 else None
        assert spin == ("0" if threads > 1 else None)
        out = rt.infer_sync({"x": np.zeros((4, 64), np.float32)})
        assert out["logits"].shape == (4, 10)
    finally:
        rt.unload_sync()
