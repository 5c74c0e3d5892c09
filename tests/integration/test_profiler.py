"""Profiling real variants: measured accuracy, bounded timing, conversion to the catalog's Profile."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import numpy as np
import pytest

from mesh.errors import ConfigError
from tests.helpers_models import digits_split, trained_mlp_onnx
from variant_store.generate import generate_variants
from variant_store.hardware import gpu_available, local_hardware_class
from variant_store.meta import VariantMeta
from variant_store.profiler import measure_accuracy, profile_variant
from variant_store.runtimes import open_runtime

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prof")
    parent = trained_mlp_onnx(root / "mlp.onnx")
    made, _ = generate_variants(parent, digits_split().x_train[:256], root / "out",
                                kinds=["onnx.fp32", "onnx.int8-dynamic", "tflite.int8"])
    return {v.kind: v.path for v in made}


def _direct_accuracy(fmt: str, path: Path) -> float:
    rt = open_runtime(fmt, path)
    rt.load_sync()
    try:
        split = digits_split()
        return float(np.mean(rt.infer_sync({"x": split.x_val})["logits"].argmax(1) == split.y_val))
    finally:
        rt.unload_sync()


@pytest.mark.parametrize(("kind", "fmt"), [("onnx.fp32", "onnx"), ("onnx.int8-dynamic", "onnx"),
                                           ("tflite.int8", "tflite")])
def test_profile_measures_accuracy_latency_and_memory(variants: dict[str, Path], kind: str, fmt: str) -> None:
    split = digits_split()
    t0 = time.monotonic()
    res = profile_variant(fmt, variants[kind], split.x_val, split.y_val, batch_sizes=(1, 8, 32),
                          repeats=20)
    assert time.monotonic() - t0 < 30
    assert res.accuracy == pytest.approx(_direct_accuracy(fmt, variants[kind]))
    assert res.accuracy > 0.93 and res.metric == "top1"
    assert sorted(res.latency) == [1, 8, 32]
    for bs, stats in res.latency.items():
        assert 0 < stats.p50_ms <= stats.p99_ms, bs
        assert 1 <= res.runs[bs] <= 20
    assert res.load_ms > 0 and res.peak_memory_bytes >= variants[kind].stat().st_size
    assert res.hardware_class == f"cpu-{platform.machine().lower()}"
    if fmt == "onnx":
        assert res.providers == ["CPUExecutionProvider"]


def test_profile_converts_to_catalog_profile_and_round_trips(variants: dict[str, Path]) -> None:
    split = digits_split()
    res = profile_variant("onnx", variants["onnx.fp32"], split.x_val, split.y_val, batch_sizes=(1, 32),
                          repeats=5)
    prof = res.to_profile(measured_at=123.0)
    assert prof.hardware_class == res.hardware_class and prof.measured_at == 123.0
    assert prof.compute_ms(1) == res.latency[1].p50_ms
    meta = VariantMeta(task="digit-classification", family="mlp", variant_id="mlp.onnx.fp32", format="onnx",
                       precision="fp32", runtime="onnxruntime", blob_digest="0" * 64,
                       size_bytes=variants["onnx.fp32"].stat().st_size, accuracy=res.accuracy,
                       profiles={prof.hardware_class: prof})
    back = VariantMeta.from_json(meta.to_json())
    assert back.profiles[prof.hardware_class].latency[32].p99_ms == res.latency[32].p99_ms


def test_cosine_metric_against_reference(variants: dict[str, Path]) -> None:
    split = digits_split()
    rt = open_runtime("onnx", variants["onnx.fp32"])
    rt.load_sync()
    try:
        ref = rt.infer_sync({"x": split.x_val})["logits"]
    finally:
        rt.unload_sync()
    same = profile_variant("onnx", variants["onnx.fp32"], split.x_val, None, metric="cosine",
                           reference_outputs=ref, batch_sizes=(1,), repeats=3)
    assert same.accuracy == pytest.approx(1.0, abs=1e-6)
    q = profile_variant("tflite", variants["tflite.int8"], split.x_val, None, metric="cosine",
                        reference_outputs=ref, batch_sizes=(1,), repeats=3)
    assert 0.95 < q.accuracy < 1.0
    assert measure_accuracy(-ref, None, "cosine", ref) == pytest.approx(-1.0)
    with pytest.raises(ConfigError):
        profile_variant("onnx", variants["onnx.fp32"], split.x_val, None, metric="cosine")
    with pytest.raises(ConfigError):
        measure_accuracy(ref, split.y_val, "f1")


def test_time_budget_bounds_repeats(variants: dict[str, Path]) -> None:
    split = digits_split()
    res = profile_variant("onnx", variants["onnx.fp32"], split.x_val, split.y_val, batch_sizes=(32,),
                          repeats=1_000_000, time_budget_s=0.2)
    assert 1 <= res.runs[32] < 1_000_000


def test_hardware_class_is_cpu_without_a_gpu() -> None:
    ok, why = gpu_available()
    if ok:
        assert local_hardware_class() == f"gpu-{why}"
    else:
        assert why and local_hardware_class() == f"cpu-{platform.machine().lower()}"
