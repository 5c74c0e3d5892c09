"""The variant catalog in etcd.

Key space (relative to the store's prefix):

    catalog/<task>/<variant_id>   VariantMeta JSON (schema 1)
    catalog/<task>/_task          the task's signature (inputs, outputs, metric)
    cascades/<task>/<cascade_id>  a calibrated cascade of the task's variants (variant_store.cascade_catalog)
    models/<task>/<family>        a registered parent model: its ONNX and validation-set digests

Model bytes never go to etcd: entries carry blob digests and the blob store holds the bytes.

Reads are tolerant (:mod:`variant_store.catalog_check`): an entry that does not decode, or whose variant id
another task catalogued first, is skipped and reported (:meth:`Catalog.read`'s ``broken``; a warning at most every
``COMPLAIN_EVERY_S`` per key), so one bad entry never fails a listing, the store's HTTP catalog or ``tiermesh up``.
Writes refuse what would make one: a family another task holds, a variant id another task holds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mesh.errors import CatalogError, StoreError
from mesh.etcd.keys import CATALOG, MODELS, TASK_NAME, catalog_key, last_segment, model_key
from mesh.etcd.ops import KV
from mesh.etcd.store import Store
from mesh.log import get_logger, kv
from mesh.types import TaskSignature, TensorSpec
from mesh.v2.datatypes import NAME_TO_V2
from variant_store.cascade_catalog import CascadeReading, put_cascade, read_cascades, remove_cascade
from variant_store.cascade_meta import CascadeMeta
from variant_store.catalog_check import BrokenEntry, Claim, family_conflict, id_conflict, shadowed_reason, winners
from variant_store.meta import SCHEMA_VERSION, VariantMeta

__all__ = [
    "COMPLAIN_EVERY_S",
    "Catalog",
    "CatalogReading",
    "RegisteredModel",
    "decode_variant",
    "signature_from_json",
    "signature_to_json",
]

log = get_logger(__name__)
COMPLAIN_EVERY_S = 10.0  # a broken entry is logged at most this often per key (the store lists on every request)


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
    version: int = 1          # which registration of its task it is (variant_store.versions)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> RegisteredModel:
        """A registration as :meth:`to_json` writes it; ``ValueError`` for anything malformed (it comes from
        etcd). Fields it does not know (a newer writer's) are dropped."""
        if not isinstance(data, dict):
            raise ValueError(f"a registered model is an object, not a {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        out: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                continue
            want = int if name in ("schema", "version") else str
            if not (isinstance(value, want) and not isinstance(value, bool)) and not (
                    name == "base_digest" and value is None):
                raise ValueError(f"a registered model's {name} is a {want.__name__}")
            if isinstance(value, str) and len(value) > 4096:
                raise ValueError(f"a registered model's {name} is at most 4096 characters")
            out[name] = value
        if not 1 <= out.get("version", 1) <= 2**31:
            raise ValueError("a registered model's version is in [1, 2**31]")
        missing = [n for n in ("task", "family", "parent_digest", "validation_digest") if n not in out]
        if missing:
            raise ValueError(f"a registered model needs {missing}")
        return cls(**out)


@dataclass(slots=True)
class CatalogReading:
    """What :meth:`Catalog.read` found: the variants readers serve (ids unique across tasks) and the entries
    they skip."""

    variants: list[VariantMeta] = field(default_factory=list)
    broken: list[BrokenEntry] = field(default_factory=list)
    created: dict[tuple[str, str], int] = field(default_factory=dict)  # (task, id) -> its key's create revision


def decode_variant(key: str, value: Any) -> VariantMeta:
    """The entry at ``catalog/<task>/<variant>``; ``ValueError``, only that, for anything else (etcd may hold any
    bytes: a ``RecursionError`` or ``OverflowError`` is as likely as a missing field)."""
    try:
        meta = VariantMeta.from_json(value)
    except Exception as exc:
        raise ValueError(str(exc)[:300] or type(exc).__name__) from exc
    parts = key.split("/")
    if len(parts) != 3 or (meta.task, meta.variant_id) != (parts[1], parts[2]):
        raise ValueError(f"the entry names task {meta.task!r}, variant {meta.variant_id!r}, not its key's")
    return meta


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
        self._complained: dict[str, float] = {}  # key -> when it was last reported broken (monotonic)

    # variants -----------------------------------------------------------------------------
    async def put_variant(self, meta: VariantMeta) -> None:
        """Catalog ``meta``; ``CatalogError`` when another task holds its id (nothing is written)."""
        _check_name("task", meta.task)
        _check_name("variant", meta.variant_id)
        held = await self.read()
        why = id_conflict(meta.task, meta.variant_id, ((m.task, m.variant_id) for m in held.variants))
        if why is not None:
            raise CatalogError(why, task=meta.task, variant=meta.variant_id)
        await self.store.put(_key(meta.task, meta.variant_id), meta.to_json())

    async def check_family_free(self, task: str, family: str) -> None:
        """``CatalogError`` naming the holder when another task has ``family`` (its ids would collide)."""
        _check_name("task", task)
        _check_name("family", family)
        if "." in family:  # ids are <family>.<kind>: a dot would let two families make one id
            raise CatalogError(f"a family name has no '.': {family!r}", task=task, family=family)
        models, _ = await self._models(None)
        held = await self.read()
        why = family_conflict(task, family, ((m.task, m.family, created) for m, created in models),
                              ((m.task, m.family, m.variant_id, held.created[(m.task, m.variant_id)])
                               for m in held.variants))
        if why is not None:
            raise CatalogError(why, task=task, family=family)

    async def read(self, task: str | None = None) -> CatalogReading:
        """Every variant readers serve (of ``task``, or all), and every catalog entry they skip: one that does
        not decode, or whose id another task catalogued first. Never raises for what an entry holds."""
        kvs = await self.store.get_prefix(CATALOG)  # all tasks: a duplicate id is one across tasks
        out = CatalogReading()
        decoded: list[tuple[VariantMeta, KV]] = []
        for item in kvs:
            parts = item.key.split("/")
            name = parts[-1]
            if name == TASK_NAME and len(parts) == 3:
                try:
                    signature_from_json(item.value)
                except Exception as exc:
                    out.broken.append(BrokenEntry(item.key, parts[1], name, f"bad task signature: {exc}"))
                continue
            try:
                decoded.append((decode_variant(item.key, item.value), item))
            except ValueError as exc:
                out.broken.append(BrokenEntry(item.key, parts[1] if len(parts) > 1 else "", name,
                                              f"malformed entry: {exc}"))
        kept = winners(Claim(m.task, m.variant_id, item.create_revision) for m, item in decoded)
        for m, item in decoded:
            out.created[(m.task, m.variant_id)] = item.create_revision
            owner = kept[m.variant_id].task
            if owner == m.task:
                out.variants.append(m)
            else:
                out.broken.append(BrokenEntry(item.key, m.task, m.variant_id, shadowed_reason(m.variant_id, owner)))
        if task is not None:
            out.variants = [m for m in out.variants if m.task == task]
            out.broken = [b for b in out.broken if b.task == task]
        out.variants.sort(key=lambda m: (m.task, m.variant_id))
        out.broken.sort(key=lambda b: b.key)
        for b in out.broken:
            self._complain(b)
        return out

    def _complain(self, b: BrokenEntry) -> None:
        now = time.monotonic()
        if now - self._complained.get(b.key, -math.inf) < COMPLAIN_EVERY_S:
            return
        self._complained[b.key] = now
        log.warning("skipping catalog entry %r: %s", b.key, b.reason[:300],
                    extra=kv(task=b.task, variant=b.name, event="catalog_broken"))

    async def get_variant(self, task: str, variant_id: str) -> VariantMeta:
        kv = await self.store.get(_key(task, variant_id))
        if kv is None or variant_id == TASK_NAME:
            raise CatalogError(f"no variant {variant_id!r} of task {task!r}", task=task, variant=variant_id)
        return self._decode(kv.value, kv.key)

    async def list_variants(self, task: str | None = None) -> list[VariantMeta]:
        """The variants readers serve (broken entries skipped and logged: :meth:`read` lists them)."""
        return (await self.read(task)).variants

    async def remove_variant(self, task: str, variant_id: str) -> None:
        if await self.store.get(_key(task, variant_id)) is None:
            raise CatalogError(f"no variant {variant_id!r} of task {task!r}", task=task, variant=variant_id)
        await self.store.delete(_key(task, variant_id))

    # cascades (issue 33: variant_store.cascade_catalog) -------------------------------------
    async def put_cascade(self, meta: CascadeMeta) -> None:
        """Catalog a calibrated cascade; ``CascadeRefused`` (nothing written) when its stages are not served
        variants of its task, differ in outputs or metric, or belong to another owner."""
        await put_cascade(self.store, meta, (await self.read(meta.task)).variants)

    async def read_cascades(self, task: str | None = None) -> CascadeReading:
        """Every cascade (of ``task``, or all) and every entry skipped as malformed (logged as variants' are)."""
        reading = await read_cascades(self.store, task)
        for b in reading.broken:
            self._complain(b)
        return reading

    async def cascades(self, task: str | None = None) -> list[CascadeMeta]:
        return (await self.read_cascades(task)).cascades

    async def remove_cascade(self, task: str, cascade_id: str) -> None:
        await remove_cascade(self.store, task, cascade_id)

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
        tasks = set()
        for item in kvs:
            if last_segment(item.key) == TASK_NAME:
                try:
                    tasks.add(signature_from_json(item.value).task)
                except Exception:  # untrusted: whatever it raises, the entry is skipped (read() reports it)
                    continue
        return sorted(tasks)

    # registered models --------------------------------------------------------------------
    async def put_model(self, model: RegisteredModel) -> None:
        await self.check_family_free(model.task, model.family)
        await self.store.put(_checked(model_key, model.task, model.family), model.to_json())

    async def get_model(self, task: str, family: str) -> RegisteredModel:
        kv = await self.store.get(_checked(model_key, task, family))
        if kv is None:
            raise CatalogError(f"no registered model {family!r} for task {task!r}", task=task, family=family)
        try:
            return RegisteredModel.from_json(kv.value)
        except ValueError as exc:
            raise CatalogError(f"malformed registration at {kv.key!r}: {exc}", task=task, family=family) from exc

    async def list_models(self, task: str | None = None) -> list[RegisteredModel]:
        """Registered models; a malformed registration is skipped and logged (:meth:`broken_models` lists it)."""
        models, broken = await self._models(task)
        for b in broken:
            self._complain(b)
        return [m for m, _ in models]

    async def broken_models(self, task: str | None = None) -> list[BrokenEntry]:
        return (await self._models(task))[1]

    async def _models(self, task: str | None) -> tuple[list[tuple[RegisteredModel, int]], list[BrokenEntry]]:
        """Registrations with their keys' create revisions, and the ones that do not decode."""
        prefix = f"{MODELS}{task}/" if task else MODELS
        out: list[tuple[RegisteredModel, int]] = []
        broken: list[BrokenEntry] = []
        for item in await self.store.get_prefix(prefix):
            parts = item.key.split("/")
            try:
                model = RegisteredModel.from_json(item.value)
                if len(parts) != 3 or (model.task, model.family) != (parts[1], parts[2]):
                    raise ValueError("the registration names another task or family than its key")
            except ValueError as exc:
                broken.append(BrokenEntry(item.key, parts[1] if len(parts) > 1 else "", parts[-1],
                                          f"malformed registration: {exc}"))
                continue
            out.append((model, item.create_revision))
        return sorted(out, key=lambda mc: (mc[0].task, mc[0].family)), broken

    @staticmethod
    def _decode(value: Any, key: str) -> VariantMeta:
        try:
            return decode_variant(key, value)
        except ValueError as exc:  # the only error it raises for a malformed entry
            raise StoreError(f"malformed catalog entry at {key!r}: {exc}") from exc
