"""Catalog integrity: one variant id names one model across the mesh, and one bad entry breaks nothing.

Why ids are unique across tasks, not only within one: placements (``placement/<site>``), heartbeats
(``live/<site>``'s loaded variants) and the policies' ``MeshSnapshot.variant_by_id`` name a variant by its id
alone, so two tasks each holding ``mlp-tiny.onnx.fp16`` would be one name for two models. Ids are
``<family>.<format>.<precision>`` (:mod:`variant_store.build`), so a family name belongs to one task, and
registration refuses a family another task holds (:func:`family_conflict`). Issue 34: a ``my-digits``
registration reusing ``mlp-tiny`` made every agent's snapshot raise ``appears twice`` ~320 times a minute.

An entry that arrives around registration (written by hand, by an older writer) may still collide or fail to
decode. Readers then keep the claim made first (the lowest etcd create revision; the task name breaks a tie,
so every reader picks the same one) and skip the rest, each reported as a :class:`BrokenEntry`, never raised.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BrokenEntry", "Claim", "family_conflict", "id_conflict", "shadowed_reason", "winners"]


@dataclass(frozen=True, slots=True)
class BrokenEntry:
    """A catalog key readers skip, and why (for ``variants list``, the console and the logs)."""

    key: str        # relative to the store prefix, e.g. ``catalog/my-digits/mlp-tiny.onnx.fp16``
    task: str
    name: str       # the variant id, ``_task`` or the family the key names
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Claim:
    """One decoded catalog entry's claim on a variant id."""

    task: str
    variant_id: str
    created: int = 0   # etcd create revision of its key (0: unknown, claims first)


def winners(claims: Iterable[Claim]) -> dict[str, Claim]:
    """Variant id -> the claim readers keep: the earliest created, then the least task name."""
    out: dict[str, Claim] = {}
    for c in claims:
        best = out.get(c.variant_id)
        if best is None or (c.created, c.task) < (best.created, best.task):
            out[c.variant_id] = c
    return out


def shadowed_reason(variant_id: str, owner_task: str) -> str:
    return (f"variant id {variant_id!r} is already task {owner_task!r}'s (catalogued first); this entry is "
            f"skipped: remove it with `tiermesh variants remove`")


def family_conflict(task: str, family: str, models: Iterable[tuple[str, str, int]],
                    variants: Iterable[tuple[str, str, str, int]]) -> str | None:
    """Why ``family`` cannot be registered for ``task``, or ``None``. ``models``: (task, family, create revision)
    of every registration; ``variants``: (task, family, variant id, create revision) of every catalogued variant.
    The family belongs to the task that claimed it first (the same rule as :func:`winners`), so the task that had
    it keeps rebuilding it even after a colliding registration slipped in before this check existed."""
    claims = [(created, other, f"registered model {other}/{fam}") for other, fam, created in models if fam == family]
    claims += [(created, other, f"variant {vid!r}") for other, fam, vid, created in variants
               if fam == family or vid.startswith(f"{family}.")]
    if not claims:
        return None
    _, holder, what = min(claims)
    if holder == task:
        return None
    return (f"family {family!r} is already used by task {holder!r} ({what}): variant ids are "
            f"<family>.<format>.<precision> and unique across the mesh, so task {task!r} needs another "
            f"family name (e.g. {f'{family}-{task}'!r}), or take the other out first with "
            f"`tiermesh variants remove --task {holder} --family {family}`")


def id_conflict(task: str, variant_id: str, variants: Iterable[tuple[str, str]]) -> str | None:
    """Why ``variant_id`` cannot be catalogued for ``task`` (another task holds it), or ``None``.
    ``variants``: (task, variant id) of every catalogued variant."""
    for other, vid in variants:
        if vid == variant_id and other != task:
            return (f"variant id {variant_id!r} is already task {other!r}'s: variant ids are unique across the "
                    f"mesh (register the model under another family name)")
    return None
