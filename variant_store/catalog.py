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
from mesh.v2.datatypes import NAME_TO_V2
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


def signature_from_json(data: Any) -> TaskSignature:
    """A task's signature as :func:`signature_to_json` writes it. It comes from etcd, so anything malformed (a
    dtype no tensor is served in, a size that is no integer) raises ``ValueError``, and only that."""
    if not isinstance(data, dict):
        raise ValueError(f"a task signature is an object, not a {type(data).__name__}")

    def text(value: Any, what: str) -> str:
        if not isinstance(value, str) or not value or len(value) > 256:
            raise ValueError(f"a task signature's {what} is a non-empty string of at most 256 characters")
        return value

    def spec(d: Any) -> TensorSpec:
        if not isinstance(d, dict) or not isinstance(d.get("dtype"), str) or d["dtype"] not in NAME_TO_V2:
            raise ValueError(f"a tensor spec names one of the dtypes {sorted(NAME_TO_V2)}")
        shape = d.get("shape")
        if not isinstance(shape, list) or len(shape) > 32 or not all(
                type(x) is int and -1 <= x < 2**31 for x in shape):
            raise ValueError("a tensor spec's shape is a list of at most 32 sizes (-1: any)")
        return TensorSpec(name=text(d.get("name"), "tensor name"), dtype=d["dtype"], shape=tuple(shape))

    def specs(value: Any, what: str) -> tuple[TensorSpec, ...]:
        if not isinstance(value, list) or len(value) > 256:
            raise ValueError(f"a task signature's {what} are a list of tensor specs")
        return tuple(spec(d) for d in value)

    return TaskSignature(task=text(data.get("task"), "task"), inputs=specs(data.get("inputs"), "inputs"),
                         outputs=specs(data.get("outputs"), "outputs"),
                         metric=text(data.get("metric", "top1"), "metric"))


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
        except ValueError as exc:  # the only error it raises for a malformed entry
            raise StoreError(f"malformed catalog entry at {key!r}: {exc}") from exc
