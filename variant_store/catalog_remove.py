"""Take a task, a family or one variant out of the catalog (``tiermesh variants remove``).

A removal is planned first (:func:`plan_removal`: the keys it deletes, read raw, so a broken entry, one that
does not decode, is removable too) and then applied (:func:`apply_removal`) in etcd transactions. Readers
follow the catalog by watch: the scheduler's next round plans without the removed variants and sites unload
them. Blobs stay in the content-addressed blob store (another entry, or another task's, may name the same
bytes); the plan lists the digests nothing left names, for whoever collects blobs.

    what            keys deleted
    task            catalog/<task>/* (its variants and signature), models/<task>/*
    task + family   models/<task>/<family>, catalog/<task>/<id> of the family's variants (by the entry's
                    family, or, for one that does not decode, an id starting ``<family>.``)
    task + variant  catalog/<task>/<variant>
    task + cascade  cascades/<task>/<cascade> (only that cascade; its variants stay)

Removing a task removes its cascades (``cascades/<task>/*``, broken ones too); removing a family or a variant also
removes every cascade of the task that chains one of the removed variants: its thresholds and measured accuracy
were calibrated on that variant's answers, so without it the entry would describe nothing that can run (refusing
instead would leave an operator unable to take out a broken variant without first hunting for its cascades).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mesh.errors import CatalogError
from mesh.etcd.keys import CATALOG, MODELS, TASK_NAME, cascade_key
from mesh.etcd.ops import Delete, chunk_ops
from variant_store.cascade_catalog import decode_cascade
from variant_store.catalog import Catalog, decode_variant

__all__ = ["Removal", "apply_removal", "plan_removal"]


@dataclass(slots=True)
class Removal:
    task: str
    family: str | None = None
    variant: str | None = None
    cascade: str | None = None
    variant_keys: list[str] = field(default_factory=list)
    model_keys: list[str] = field(default_factory=list)
    other_keys: list[str] = field(default_factory=list)     # the task's signature
    cascade_keys: list[str] = field(default_factory=list)   # cascades/<task>/<id> going with it (or alone)
    digests: list[str] = field(default_factory=list)        # blobs no remaining entry names (kept on disk)

    @property
    def keys(self) -> list[str]:
        return [*self.variant_keys, *self.model_keys, *self.other_keys, *self.cascade_keys]

    @property
    def what(self) -> str:
        if self.cascade is not None:
            return f"cascade {self.cascade!r} of task {self.task!r}"
        if self.variant is not None:
            return f"variant {self.variant!r} of task {self.task!r}"
        if self.family is not None:
            return f"family {self.family!r} of task {self.task!r}"
        return f"task {self.task!r}"

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "family": self.family, "variant": self.variant, "cascade": self.cascade,
                "keys": self.keys, "cascades": self.cascade_keys,
                "unreferenced_blobs": self.digests}


async def plan_removal(catalog: Catalog, task: str, *, family: str | None = None,
                       variant: str | None = None, cascade: str | None = None) -> Removal:
    """The keys removing ``task`` (or its ``family``, its ``variant`` or its ``cascade``) deletes; ``CatalogError``
    when there is nothing of the kind (nothing is deleted)."""
    if sum(x is not None for x in (family, variant, cascade)) > 1:
        raise CatalogError("name a family, a variant or a cascade, not several", task=task)
    for name in (task, family, variant, cascade):
        if name is not None and (not name or "/" in name):
            raise CatalogError(f"invalid name {name!r}", task=task)
    store = catalog.store
    if cascade is not None:
        plan = Removal(task=task, cascade=cascade)
        if await store.get(cascade_key(task, cascade)) is not None:
            plan.cascade_keys.append(cascade_key(task, cascade))
        else:
            raise CatalogError(f"nothing to remove: no {plan.what} (`tiermesh variants cascades` lists them)",
                               task=task)
        return plan
    entries = await store.get_prefix(f"{CATALOG}{task}/")
    models = await store.get_prefix(f"{MODELS}{task}/")
    plan = Removal(task=task, family=family, variant=variant)
    gone_digests: set[str] = set()
    for item in entries:
        name = item.key.rsplit("/", 1)[-1]
        if name == TASK_NAME:
            if family is None and variant is None:
                plan.other_keys.append(item.key)
            continue
        meta = None
        try:
            meta = decode_variant(item.key, item.value)
        except ValueError:
            pass  # a broken entry: matched by its key alone
        if variant is not None:
            hit = name == variant
        elif family is not None:
            hit = (meta.family == family) if meta is not None else name.startswith(f"{family}.")
        else:
            hit = True
        if hit:
            plan.variant_keys.append(item.key)
            if meta is not None:
                gone_digests.add(meta.blob_digest)
    if variant is None:
        plan.model_keys = [m.key for m in models if family is None or m.key.rsplit("/", 1)[-1] == family]
    gone_ids = {k.rsplit("/", 1)[-1] for k in plan.variant_keys}
    whole = family is None and variant is None
    for item in await store.get_prefix(cascade_key(task)):
        try:
            hit = whole or bool(gone_ids & set(decode_cascade(item.key, item.value).stages))
        except ValueError:
            hit = whole  # a broken cascade goes with its task only (or alone: `--cascade`)
        if hit:
            plan.cascade_keys.append(item.key)
    if not plan.keys:
        raise CatalogError(f"nothing to remove: no {plan.what} in the catalog (`tiermesh variants list` shows "
                           f"what there is)", task=task)
    removed = set(plan.keys)
    left = [m for m in (await catalog.read()).variants if f"{CATALOG}{m.task}/{m.variant_id}" not in removed]
    still = {d for m in left for d in (m.blob_digest, m.shared_base_digest) if d}
    plan.digests = sorted(gone_digests - still)
    return plan


async def apply_removal(catalog: Catalog, plan: Removal) -> int:
    """Delete the planned keys (in as few transactions as etcd allows); returns how many were deleted."""
    deleted = 0
    for part in chunk_ops([Delete(k) for k in plan.keys]):
        await catalog.store.txn([], part)
        deleted += len(part)
    return deleted
