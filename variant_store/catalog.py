"""The variant catalog in etcd.

Key space (relative to the store's prefix):

    catalog/<task>/<variant_id>   VariantMeta JSON (schema 1)
    catalog/<task>/_task          the task's signature (inputs, outputs, metric)
    models/<task>/<family>        a registered parent model: its ONNX and validation-set digests

Model bytes never go to etcd: entries carry blob digests and the blob store holds the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mesh.errors import CatalogError, StoreError
from mesh.etcd.keys import CATALOG, MODELS, TASK_NAME, catalog_key, last_segment, model_key
from mesh.etcd.store import Store
from mesh.types import TaskSignature, TensorSpec
from variant_store.meta import SCHEMA_VERSION, VariantMeta

__all__ = [
    "Catalog",
    "RegisteredModel",
    "signature_from_json",
    "signature_to_json",
]



@dataclass(slots=True)
class RegisteredModel:
    """A model owner's registration: the FP32 parent and the labelled data to measure it on."""

    task: str
    family: str
    parent_digest: str        # sha256 of the parent ONNX blob
    validation_digest: str    # sha256 of the .npz (x, y, calib_count) blob
    owner: str = "public"
    metric: str = "top1"
    role: str = "model"       # "model" | "backbone" | "head"
    base_digest: str | None = None  # for a head: the blob of the backbone whose features it eats
    schema: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RegisteredModel:
        return cls(**data)


def signature_to_json(sig: TaskSignature) -> dict[str, Any]:
    def spec(s: TensorSpec) -> dict[str, Any]:
        return {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}

    return {"task": sig.task, "inputs": [spec(s) for s in sig.inputs],
            "outputs": [spec(s) for s in sig.outputs], "metric": sig.metric, "schema": SCHEMA_VERSION}


def signature_from_json(data: dict[str, Any]) -> TaskSignature:
    def spec(d: dict[str, Any]) -> TensorSpec:
        return TensorSpec(name=d["name"], dtype=d["dtype"], shape=tuple(int(x) for x in d["shape"]))

    return TaskSignature(task=data["task"], inputs=tuple(spec(d) for d in data["inputs"]),
                         outputs=tuple(spec(d) for d in data["outputs"]), metric=data.get("metric", "top1"))


def _check_name(kind: str, name: str) -> None:
    # a "/" would silently nest keys and make the entry unreachable by list_variants
    if not name or "/" in name or name.startswith("_"):
        raise CatalogError(f"invalid {kind} name: {name!r}", name=name)


def _checked(build: Callable[[str, str], str], task: str, name: str) -> str:
    """A catalog key from ``mesh.etcd.keys``, its ValueError as this module's CatalogError."""
    try:
        return build(task, name)
    except ValueError as exc:
        raise CatalogError(str(exc), task=task, name=name) from exc


def _key(task: str, variant_id: str) -> str:
    return _checked(catalog_key, task, variant_id)


class Catalog:
    """Typed access to the catalog keys. Holds no state of its own: etcd is the truth."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # variants -----------------------------------------------------------------------------
    async def put_variant(self, meta: VariantMeta) -> None:
        _check_name("task", meta.task)
        _check_name("variant", meta.variant_id)
        await self.store.put(_key(meta.task, meta.variant_id), meta.to_json())

    async def get_variant(self, task: str, variant_id: str) -> VariantMeta:
        kv = await self.store.get(_key(task, variant_id))
        if kv is None or variant_id == TASK_NAME:
            raise CatalogError(f"no variant {variant_id!r} of task {task!r}", task=task, variant=variant_id)
        return self._decode(kv.value, kv.key)

    async def list_variants(self, task: str | None = None) -> list[VariantMeta]:
        prefix = f"{CATALOG}{task}/" if task else CATALOG
        out = [self._decode(kv.value, kv.key) for kv in await self.store.get_prefix(prefix)
               if last_segment(kv.key) != TASK_NAME]
        return sorted(out, key=lambda m: (m.task, m.variant_id))

    async def remove_variant(self, task: str, variant_id: str) -> None:
        if await self.store.get(_key(task, variant_id)) is None:
            raise CatalogError(f"no variant {variant_id!r} of task {task!r}", task=task, variant=variant_id)
        await self.store.delete(_key(task, variant_id))

    # tasks --------------------------------------------------------------------------------
    async def put_task(self, sig: TaskSignature) -> None:
        _check_name("task", sig.task)
        await self.store.put(_key(sig.task, TASK_NAME), signature_to_json(sig))

    async def get_task(self, task: str) -> TaskSignature:
        kv = await self.store.get(_key(task, TASK_NAME))
        if kv is None:
            raise CatalogError(f"unknown task {task!r}", task=task)
        return signature_from_json(kv.value)

    async def list_tasks(self) -> list[str]:
        kvs = await self.store.get_prefix(CATALOG)
        tasks = {signature_from_json(kv.value).task for kv in kvs if last_segment(kv.key) == TASK_NAME}
        return sorted(tasks)

    # registered models --------------------------------------------------------------------
    async def put_model(self, model: RegisteredModel) -> None:
        _check_name("task", model.task)
        _check_name("family", model.family)
        await self.store.put(_checked(model_key, model.task, model.family), model.to_json())

    async def get_model(self, task: str, family: str) -> RegisteredModel:
        kv = await self.store.get(_checked(model_key, task, family))
        if kv is None:
            raise CatalogError(f"no registered model {family!r} for task {task!r}", task=task, family=family)
        return RegisteredModel.from_json(kv.value)

    async def list_models(self, task: str | None = None) -> list[RegisteredModel]:
        prefix = f"{MODELS}{task}/" if task else MODELS
        out = [RegisteredModel.from_json(kv.value) for kv in await self.store.get_prefix(prefix)]
        return sorted(out, key=lambda m: (m.task, m.family))

    @staticmethod
    def _decode(value: Any, key: Any) -> VariantMeta:
        try:
            return VariantMeta.from_json(value)
        except (TypeError, KeyError, AttributeError) as exc:
            raise StoreError(f"malformed catalog entry at {key!r}: {exc}") from exc
