"""The catalog on a real etcd: round trips of variants, task signatures and registered models."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.errors import CatalogError
from mesh.types import TaskSignature, TensorSpec
from variant_store.catalog import Catalog, RegisteredModel
from variant_store.meta import LatencyStats, Profile, VariantMeta

pytestmark = pytest.mark.integration

SIG = TaskSignature(
    task="digit-classification",
    inputs=(TensorSpec("x", "float32", (-1, 64)),),
    outputs=(TensorSpec("logits", "float32", (-1, 10)),),
)


def _meta(variant_id: str, task: str = "digit-classification", **over: Any) -> VariantMeta:
    prof = Profile(hardware_class="cpu-x86_64", load_ms=3.5,
                   latency={1: LatencyStats(0.05, 0.09), 8: LatencyStats(0.1, 0.2),
                            32: LatencyStats(0.3, 0.5)},
                   peak_memory_bytes=1 << 20, providers=["CPUExecutionProvider"], measured_at=1.0)
    fields: dict[str, Any] = dict(
        task=task, family=variant_id.split(".")[0], variant_id=variant_id, format="onnx", precision="int8",
        runtime="onnxruntime", blob_digest="ab" * 32, size_bytes=12345, accuracy=0.9712,
        inputs=[{"name": "x", "dtype": "float32", "shape": [-1, 64]}],
        outputs=[{"name": "logits", "dtype": "float32", "shape": [-1, 10]}],
        parent=f"{variant_id.split('.')[0]}.onnx.fp32", profiles={"cpu-x86_64": prof},
    )
    fields.update(over)
    return VariantMeta(**fields)


async def test_variant_round_trip_keeps_every_field(store: Any) -> None:
    cat = Catalog(store)
    meta = _meta("mlp-tiny.onnx.int8-dynamic", shared_base_digest="cd" * 32, owner="acme")
    await cat.put_variant(meta)
    got = await cat.get_variant(meta.task, meta.variant_id)
    assert got == meta
    assert got.profiles["cpu-x86_64"].latency[8].p99_ms == 0.2  # int batch keys survive JSON
    assert got.profiles["cpu-x86_64"].compute_ms(4) == pytest.approx(0.05 + (0.1 - 0.05) * 3 / 7)


async def test_list_filters_by_task_and_skips_the_task_record(store: Any) -> None:
    cat = Catalog(store)
    await cat.put_task(SIG)
    await cat.put_task(TaskSignature("text-embedding", (TensorSpec("ids", "int64", (-1, 128)),),
                                     (TensorSpec("emb", "float32", (-1, 384)),), metric="cosine"))
    for vid in ("mlp-tiny.onnx.fp32", "cnn-small.onnx.int8-static"):
        await cat.put_variant(_meta(vid))
    await cat.put_variant(_meta("minilm.onnx.fp32", task="text-embedding", metric="cosine"))
    digits = await cat.list_variants("digit-classification")
    assert [m.variant_id for m in digits] == ["cnn-small.onnx.int8-static", "mlp-tiny.onnx.fp32"]
    assert len(await cat.list_variants()) == 3
    assert await cat.list_tasks() == ["digit-classification", "text-embedding"]
    assert await cat.get_task("digit-classification") == SIG
    assert (await cat.get_task("text-embedding")).metric == "cosine"


async def test_missing_entries_raise_catalog_error(store: Any) -> None:
    cat = Catalog(store)
    with pytest.raises(CatalogError):
        await cat.get_variant("digit-classification", "nope")
    with pytest.raises(CatalogError):
        await cat.get_task("no-such-task")
    with pytest.raises(CatalogError):
        await cat.get_model("digit-classification", "nope")
    with pytest.raises(CatalogError):
        await cat.remove_variant("digit-classification", "nope")
    await cat.put_task(SIG)
    with pytest.raises(CatalogError):  # the task record is not a variant
        await cat.get_variant("digit-classification", "_task")


async def test_remove_variant(store: Any) -> None:
    cat = Catalog(store)
    await cat.put_variant(_meta("mlp-tiny.onnx.fp32"))
    await cat.put_variant(_meta("mlp-tiny.onnx.int8-dynamic"))
    await cat.remove_variant("digit-classification", "mlp-tiny.onnx.fp32")
    assert [m.variant_id for m in await cat.list_variants()] == ["mlp-tiny.onnx.int8-dynamic"]


async def test_names_that_would_nest_keys_are_refused(store: Any) -> None:
    cat = Catalog(store)
    with pytest.raises(CatalogError):
        await cat.put_variant(_meta("evil/nested"))
    with pytest.raises(CatalogError):
        await cat.put_variant(_meta("_task"))
    assert await cat.list_variants() == []


async def test_registered_model_round_trip(store: Any) -> None:
    cat = Catalog(store)
    m = RegisteredModel(task="digit-classification", family="mlp-tiny", parent_digest="01" * 32,
                        validation_digest="02" * 32, owner="acme")
    head = RegisteredModel(task="digit-classification", family="head-a", parent_digest="03" * 32,
                           validation_digest="02" * 32, role="head", base_digest="04" * 32)
    await cat.put_model(m)
    await cat.put_model(head)
    assert await cat.get_model("digit-classification", "mlp-tiny") == m
    assert [x.family for x in await cat.list_models("digit-classification")] == ["head-a", "mlp-tiny"]
    assert await cat.list_models("text-embedding") == []
