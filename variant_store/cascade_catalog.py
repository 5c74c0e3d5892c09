"""Calibrated cascades in etcd (``cascades/<task>/<cascade_id>``, :mod:`variant_store.cascade_meta`): decoding,
reading, checking and writing them. :class:`variant_store.catalog.Catalog` delegates here (``put_cascade``,
``cascades``, ``remove_cascade``), and the mesh's view decodes with :func:`decode_cascade` too, so an entry means
the same to the store, the CLI and routing.

Reads are tolerant as the variant catalog's are (:mod:`variant_store.catalog_check`): an entry that does not
decode, or whose key names another task or id than the entry, is skipped and reported as a
:class:`~variant_store.catalog_check.BrokenEntry`, never raised. Writes refuse (``CascadeRefused``, nothing written)
a cascade whose stages are not catalogued variants of its task, are not top-1 classifiers of one class count, or
belong to two tenants: what the router would run must be what was calibrated.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mesh.errors import CascadeRefused, CatalogError
from mesh.etcd.keys import CASCADES, cascade_key
from mesh.etcd.store import Store
from variant_store.cascade_meta import CascadeMeta
from variant_store.catalog_check import BrokenEntry
from variant_store.meta import PUBLIC, VariantMeta

__all__ = ["CascadeReading", "check_stages", "classes_of", "decode_cascade", "get_cascade", "put_cascade",
           "read_cascades", "remove_cascade", "stage_owner"]


@dataclass(slots=True)
class CascadeReading:
    """What :func:`read_cascades` found: the entries readers use and the ones they skip."""

    cascades: list[CascadeMeta] = field(default_factory=list)
    broken: list[BrokenEntry] = field(default_factory=list)


def decode_cascade(key: str, value: Any) -> CascadeMeta:
    """The entry at ``cascades/<task>/<id>`` (``key`` relative to the store prefix); ``ValueError``, only that,
    for anything else (etcd may hold any bytes)."""
    try:
        meta = CascadeMeta.from_json(value)
    except Exception as exc:  # hostile input: RecursionError, OverflowError, TypeError are as likely
        raise ValueError(str(exc)[:300] or type(exc).__name__) from exc
    parts = key.split("/")
    if len(parts) != 3 or f"{parts[0]}/" != CASCADES or (meta.task, meta.cascade_id) != (parts[1], parts[2]):
        raise ValueError(f"the entry names task {meta.task!r}, cascade {meta.cascade_id!r}, not its key's")
    return meta


def classes_of(meta: VariantMeta) -> tuple[Any, ...]:
    """A variant's output signature as a cascade compares it: each output's name-free shape past the batch."""
    return tuple(tuple(o.get("shape", ())[1:]) for o in meta.outputs)


def stage_owner(stages: Iterable[VariantMeta]) -> str:
    """Who may run the cascade: PUBLIC when every stage is public, else the one tenant whose stages it chains;
    ``CascadeRefused`` for stages of two tenants (no caller may run both)."""
    owners = {m.owner for m in stages} - {PUBLIC}
    if len(owners) > 1:
        raise CascadeRefused(f"a cascade chains variants of one tenant at most, not {sorted(owners)}",
                             reason="owner")
    return owners.pop() if owners else PUBLIC


def check_stages(task: str, stages: tuple[str, ...], variants: Iterable[VariantMeta]) -> list[VariantMeta]:
    """The catalogued variants ``stages`` name, in order; ``CascadeRefused`` when one is not a variant of
    ``task``, one is not scored top-1, or their outputs differ (a cascade answers with whichever stage is sure,
    so every stage must answer the same question in the same classes)."""
    by_id = {m.variant_id: m for m in variants if m.task == task}
    if len(stages) < 2:
        raise CascadeRefused("a cascade needs at least two stages", reason="stages", task=task)
    if len(set(stages)) != len(stages):
        raise CascadeRefused(f"a cascade names each variant once: {list(stages)}", reason="stages", task=task)
    missing = [s for s in stages if s not in by_id]
    if missing:
        raise CascadeRefused(f"not variants of task {task!r}: {missing} (`tiermesh variants list --task {task}`)",
                             reason="stages", task=task)
    metas = [by_id[s] for s in stages]
    not_top1 = [m.variant_id for m in metas if m.metric != "top1"]
    if not_top1:
        raise CascadeRefused(f"a cascade needs top-1 classifiers; {not_top1} are scored otherwise",
                             reason="metric", task=task)
    sigs = {m.variant_id: classes_of(m) for m in metas}
    if len(set(sigs.values())) != 1:
        raise CascadeRefused(f"the stages' outputs differ (classes): {sigs}", reason="stages", task=task)
    return metas


async def read_cascades(store: Store, task: str | None = None) -> CascadeReading:
    """Every cascade entry (of ``task``, or all) that decodes, and every one that does not. Never raises for
    what an entry holds."""
    prefix = cascade_key(task) if task is not None else CASCADES
    out = CascadeReading()
    for item in await store.get_prefix(prefix):
        parts = item.key.split("/")
        try:
            out.cascades.append(decode_cascade(item.key, item.value))
        except ValueError as exc:
            out.broken.append(BrokenEntry(item.key, parts[1] if len(parts) > 1 else "", parts[-1],
                                          f"malformed cascade: {exc}"))
    out.cascades.sort(key=lambda c: (c.task, c.cascade_id))
    out.broken.sort(key=lambda b: b.key)
    return out


async def get_cascade(store: Store, task: str, cascade_id: str) -> CascadeMeta:
    kv = await store.get(_key(task, cascade_id))
    if kv is None:
        raise CatalogError(f"no cascade {cascade_id!r} of task {task!r}", task=task, cascade=cascade_id)
    try:
        return decode_cascade(kv.key, kv.value)
    except ValueError as exc:
        raise CatalogError(f"malformed cascade at {kv.key!r}: {exc}", task=task, cascade=cascade_id) from exc


async def put_cascade(store: Store, meta: CascadeMeta, variants: Iterable[VariantMeta]) -> None:
    """Write ``meta`` after checking its stages against the catalogued ``variants`` (``CascadeRefused``)."""
    metas = check_stages(meta.task, meta.stages, variants)
    if stage_owner(metas) != meta.owner:
        raise CascadeRefused(f"cascade {meta.cascade_id!r} says owner {meta.owner!r}, its stages are "
                             f"{stage_owner(metas)!r}'s", reason="owner", task=meta.task)
    await store.put(_key(meta.task, meta.cascade_id), meta.to_json())


async def remove_cascade(store: Store, task: str, cascade_id: str) -> None:
    """Delete the entry (broken or not); ``CatalogError`` when there is none."""
    key = _key(task, cascade_id)
    if await store.get(key) is None:
        raise CatalogError(f"no cascade {cascade_id!r} of task {task!r} (`tiermesh variants cascades`)",
                           task=task, cascade=cascade_id)
    await store.delete(key)


def _key(task: str, cascade_id: str) -> str:
    try:
        return cascade_key(task, cascade_id)
    except ValueError as exc:
        raise CatalogError(str(exc), task=task, cascade=cascade_id) from exc
