"""Hardware detection: GPU names shorten to a class, every runtime is reported with a reason, and a
run's providers decide its hardware class (a torch-cuda run is a GPU class of its own)."""

from __future__ import annotations

import platform

import pytest

from variant_store import hardware

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("name", "short"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("Tesla T4", "t4"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA L40S", "l40s"),
    ("", "cuda")])
def test_short_gpu_model(name: str, short: str) -> None:
    assert hardware.short_gpu_model(name) == short


def test_runtime_support_lists_every_runtime_with_a_reason() -> None:
    rows = hardware.runtime_support()
    assert [r.runtime for r in rows] == ["onnxruntime-cpu", "onnxruntime-cuda", "onnxruntime-tensorrt",
                                         "tensorrt", "torch-cuda", "tflite"]
    assert all(r.detail for r in rows)
    assert "onnxruntime-cpu" in hardware.runnable_runtimes()
    assert set(hardware.runnable_runtimes()) == {r.runtime for r in rows if r.ok}


def test_torch_cuda_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "torch_cuda_available", lambda: (True, "h100"))
    assert hardware.hardware_class_for(["torch-cuda-fp16-graphs"]) == "gpu-h100"
    assert hardware.hardware_class_for(["torch-cpu-fp32-eager"]) == f"cpu-{platform.machine().lower()}"
    assert hardware.hardware_class_for(["CPUExecutionProvider"]) == f"cpu-{platform.machine().lower()}"


def test_runtime_support_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "torch_cuda_available", lambda: (False, "torch sees no CUDA device"))
    monkeypatch.setattr(hardware, "gpu_available", lambda: (False, "no CUDA device (/dev/nvidia* absent)"))
    rows = {r.runtime: r for r in hardware.runtime_support()}
    for name in ("onnxruntime-cuda", "onnxruntime-tensorrt", "tensorrt", "torch-cuda"):
        assert not rows[name].ok and rows[name].detail
    assert rows["torch-cuda"].detail == "torch sees no CUDA device"


def test_tensorrt_needs_a_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "_ort_providers", lambda: ["CPUExecutionProvider"])
    monkeypatch.setattr(hardware.importlib.util, "find_spec", lambda name: None)
    ok, why = hardware.tensorrt_available()
    assert not ok and "neither the tensorrt package" in why


@pytest.mark.parametrize(("nodes", "ort_gpu", "torch_ok", "env", "serves"), [
    (True, False, True, None, True),     # a GPU that only PyTorch reaches: served through torch-cuda
    (True, False, True, "0", False),     # ... unless turned off
    (True, True, True, None, False),     # ONNX Runtime reaches it itself
    (True, False, False, None, False),   # torch sees no CUDA device
    (False, False, True, None, False),   # no device node: torch is never asked
])
def test_torch_serving_and_the_site_class(monkeypatch: pytest.MonkeyPatch, nodes: bool, ort_gpu: bool,
                                          torch_ok: bool, env: str | None, serves: bool) -> None:
    asked: list[bool] = []

    def torch_cuda() -> tuple[bool, str]:
        asked.append(True)
        return (True, "h100") if torch_ok else (False, "torch sees no CUDA device")

    monkeypatch.setattr(hardware, "_cuda_device_nodes", lambda: nodes)
    monkeypatch.setattr(hardware, "gpu_available", lambda: (True, "h100") if ort_gpu else (False, "cpu only"))
    monkeypatch.setattr(hardware, "torch_cuda_available", torch_cuda)
    if env is None:
        monkeypatch.delenv("TIERMESH_TORCH_CUDA", raising=False)
    else:
        monkeypatch.setenv("TIERMESH_TORCH_CUDA", env)
    assert hardware.torch_serving()[0] is serves
    assert hardware.serving_runtime("onnx") == ("torch-cuda" if serves else "onnx")
    assert hardware.serving_runtime("tflite") == "tflite"
    gpu_class = serves or ort_gpu
    assert hardware.local_hardware_class(0.5) == ("gpu-h100" if gpu_class else
                                                  f"cpu-{platform.machine().lower()}-cap0.50")
    if not nodes:
        assert not asked
