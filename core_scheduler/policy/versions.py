"""Routing's version filter (issue 34 item 3): which version of a task a query is served by.

A tenant task's variants carry their version and that version's share of the task's traffic
(``VariantInfo.version`` / ``share``, mirrored by the variant store from ``versions/<task>``:
:mod:`variant_store.versions`). A query that pins a version gets it; any other draws one by share. Pure: the
caller passes the draw (uniform in [0, 1)), so a seeded generator gives reproducible draws.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from core_scheduler.policy.routing_candidates import TaskTable, build_candidates
from core_scheduler.policy.snapshot import MeshSnapshot, VariantInfo
from mesh.errors import NoRoute, UnknownTask

__all__ = ["VersionTables", "pick_version", "version_shares", "version_tables"]

# task -> (each version's share, the task's candidates of that version alone)
VersionTables = Mapping[str, tuple[Mapping[int, float], Mapping[int, TaskTable]]]


def version_shares(variants: Iterable[VariantInfo]) -> dict[int, float]:
    """Each version of the variants and its share (the largest its variants carry: a move rewrites them one by one)."""
    out: dict[int, float] = {}
    for v in variants:
        out[v.version] = max(out.get(v.version, 0.0), v.share)
    return out


def pick_version(task: str, shares: Mapping[int, float], pin: int | None, draw: float) -> int:
    """The version a query is served by: ``pin`` when given (``UnknownTask`` when the task has no such version
    catalogued), else one drawn by share with ``draw`` in [0, 1). When no version has a share, ``NoRoute``: every
    version is held (below the task's declared accuracy) or still building, and a held version is not served
    unless pinned (a move raises the new version's shares before lowering the old one's, so it never passes
    through a moment with none)."""
    if pin is not None:
        if pin not in shares:
            raise UnknownTask(f"task {task!r} has no version {pin} (versions: {sorted(shares)})", task=task,
                              version=pin)
        return pin
    live = sorted((v, s) for v, s in shares.items() if s > 0)
    if not live:
        raise NoRoute(f"task {task!r} has no version taking traffic: versions {sorted(shares)} are held or still "
                      f"building (pin one with parameters.version to query it anyway)", task=task)
    total = sum(s for _, s in live)
    point = min(max(draw, 0.0), 1.0) * total
    acc = 0.0
    for v, s in live:
        acc += s
        if point < acc:
            return v
    return live[-1][0]


def version_tables(snap: MeshSnapshot, here: str, tasks: Mapping[str, TaskTable]) -> VersionTables:
    """The version filter's tables: for a task with more than one version catalogued, one candidate table per
    version; for a task whose one version is not 1, or takes no traffic (held), that version and the task's table
    (a pin names it). Tasks catalogued before versions (all version 1, share 1) are left out: routing them is
    unchanged."""
    out: dict[str, tuple[Mapping[int, float], Mapping[int, TaskTable]]] = {}
    for task, vs in snap.variants.items():
        shares = version_shares(vs)
        if len(shares) > 1:
            out[task] = (shares, {n: TaskTable(build_candidates(snap, here, tuple(v for v in vs if v.version == n)),
                                               here) for n in shares})
        elif shares and (set(shares) != {1} or not any(s > 0 for s in shares.values())) and task in tasks:
            out[task] = (shares, {n: tasks[task] for n in shares})
    return out
