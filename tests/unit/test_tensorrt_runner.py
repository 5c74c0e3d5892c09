"""The TensorRT engine path on the CPU, against a fake engine: contexts are never shared between
concurrent calls, and outputs keep the dtypes the engine declares (no blanket float32 cast).

The fakes stand in for ``tensorrt`` and ``torch`` with numpy arrays: a "device pointer" is the
array's host address, and the fake context computes from whatever address was bound to it when it
runs, as a real one does, so a context shared between threads gives wrong answers here too.
"""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from variant_store.runtimes.tensorrt_rt import EngineRunner

pytestmark = pytest.mark.unit


class _Tensor:
    def __init__(self, arr: np.ndarray) -> None:
        self.arr = np.ascontiguousarray(arr)
        self.shape = self.arr.shape

    def to(self, _device: str) -> _Tensor:
        return _Tensor(self.arr.copy())

    def data_ptr(self) -> int:
        return int(self.arr.ctypes.data)

    def cpu(self) -> _Tensor:
        return self

    def numpy(self) -> np.ndarray:
        return self.arr


class _Stream:
    cuda_stream = 0

    def wait_stream(self, _other: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _fake_torch() -> Any:
    cuda = SimpleNamespace(Stream=_Stream, current_stream=_Stream)
    return SimpleNamespace(
        from_numpy=_Tensor, cuda=cuda,
        empty=lambda shape, dtype, device: _Tensor(np.empty(shape, dtype=dtype)),
        float32=np.float32, float16=np.float16, int64=np.int64)


_FAKE_TRT = SimpleNamespace(nptype=lambda d: d, TensorIOMode=SimpleNamespace(INPUT="in", OUTPUT="out"))


def _view(ptr: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * n).from_address(ptr), dtype=dtype).reshape(shape)


class _Context:
    """Reads the bound input at execute time, sleeps (so a sharing bug shows), writes the outputs."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addr: dict[str, int] = {}
        self.busy = False

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None:
        self.shapes[name] = shape

    def set_tensor_address(self, name: str, ptr: int) -> None:
        self.addr[name] = ptr

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (self.shapes["x"][0], 3) if name == "scores" else (self.shapes["x"][0],)

    def execute_async_v3(self, _stream: int) -> bool:
        if self.busy:
            self.engine.overlaps += 1
        self.busy = True
        try:
            x = _view(self.addr["x"], self.shapes["x"], np.float32).copy()
            time.sleep(0.002)
            scores = _view(self.addr["scores"], (len(x), 3), np.float16)
            scores[:] = (x[:, :3] * 2).astype(np.float16)
            _view(self.addr["label"], (len(x),), np.int64)[:] = x[:, :3].argmax(1)
            return True
        finally:
            self.busy = False


class _Engine:
    io = (("x", np.float32, (-1, 4), "in"), ("scores", np.float16, (-1, 3), "out"),
          ("label", np.int64, (-1,), "out"))
    num_io_tensors = 3

    def __init__(self) -> None:
        self.overlaps = 0

    def get_tensor_name(self, i: int) -> str:
        return self.io[i][0]

    def _row(self, name: str) -> tuple[Any, ...]:
        return next(r for r in self.io if r[0] == name)

    def get_tensor_dtype(self, name: str) -> Any:
        return self._row(name)[1]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._row(name)[2]

    def get_tensor_mode(self, name: str) -> str:
        return self._row(name)[3]

    def create_execution_context(self) -> _Context:
        return _Context(self)


def test_specs_come_from_the_engine() -> None:
    runner = EngineRunner(_Engine(), _FAKE_TRT, _fake_torch())
    assert [(s.name, s.dtype) for s in runner.input_specs] == [("x", "float32")]
    assert [(s.name, s.dtype, s.shape) for s in runner.output_specs] == [
        ("scores", "float16", (-1, 3)), ("label", "int64", (-1,))]


def test_outputs_keep_declared_dtypes() -> None:
    runner = EngineRunner(_Engine(), _FAKE_TRT, _fake_torch())
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = runner.run({"x": x})
    assert out["scores"].dtype == np.float16 and out["label"].dtype == np.int64
    np.testing.assert_array_equal(out["scores"], (x[:, :3] * 2).astype(np.float16))
    np.testing.assert_array_equal(out["label"], [2, 2])


def test_concurrent_calls_never_share_a_context() -> None:
    engine = _Engine()
    runner = EngineRunner(engine, _FAKE_TRT, _fake_torch())
    rng = np.random.default_rng(0)
    batches = [rng.random((int(rng.integers(1, 6)), 4), dtype=np.float32) for _ in range(96)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda x: runner.run({"x": x}), batches))
    assert engine.overlaps == 0
    for x, out in zip(batches, results, strict=True):
        np.testing.assert_array_equal(out["label"], x[:, :3].argmax(1))
        np.testing.assert_array_equal(out["scores"], (x[:, :3] * 2).astype(np.float16))
    # contexts are reused: never more than the number of threads that ran at once
    assert 1 <= runner.contexts_created <= 8


def test_a_failed_run_returns_its_context() -> None:
    runner = EngineRunner(_Engine(), _FAKE_TRT, _fake_torch())
    with pytest.raises(KeyError):
        runner.run({"wrong": np.zeros((1, 4), np.float32)})
    runner.run({"x": np.zeros((1, 4), np.float32)})
    assert runner.contexts_created == 1
