"""The variant store's side of a tenant task's versions (issue 34 item 3; the records and rules are
:mod:`variant_store.versions`): numbering a build's version, moving traffic when it is built, retiring the old
version after its grace, and answering doors' traffic and delete requests (``modelops/<tenant>/<id>``).

Writes to ``versions/<task>`` are compare-and-swaps on the revision read (a door's op and a build finishing may race);
traffic shares are mirrored into the variants' catalog entries, the new shares up before the old ones down.

Deleting a task takes its variants, registrations, cascades and signature out of the catalog
(``variant_store.catalog_remove``) and its version record, and then collects its blobs *at once*: every blob a
removed variant or registration named that no remaining entry names (``BlobStore.remove``). Sites hold their own copy
of what they loaded, and placement drops the task as soon as its catalog entries go, so nothing fetches those
blobs afterwards (a fetch already running fails with a 404 and the variant, gone from the catalog, is not retried).
No query reaches a removed variant (routing follows the catalog), and a site unloads one once nothing has used it
for ``edge_agent.agent.GONE_UNLOAD_S`` (10 s), not the idle-unload time of variants still catalogued.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mesh.errors import CatalogError, MeshError
from mesh.etcd.keys import MODEL_OPS, version_key
from mesh.etcd.ops import CreateRevision, ModRevision, Put
from mesh.log import get_logger, kv
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog, RegisteredModel
from variant_store.catalog_remove import apply_removal, plan_removal
from variant_store.meta import VariantMeta
from variant_store.versions import (
    ModelOp,
    VersionInfo,
    VersionRecord,
    due_retirements,
    move_verdict,
    next_version,
    normalise_weights,
    shares_of,
)

__all__ = ["StampedCatalog", "VersionKeeper"]

log = get_logger(__name__)
ANSWER_TTL_S = 300.0  # an answered op no door collected (the door died) is swept after this


class StampedCatalog(Catalog):
    """``catalog`` as a build sees it: every variant and registration it writes is version ``version`` of its task,
    its variants with traffic share ``share`` (0 while another version serves)."""

    def __init__(self, catalog: Catalog, version: int, share: float) -> None:
        super().__init__(catalog.store)
        self.version, self.share = version, share

    async def put_variant(self, meta: VariantMeta) -> None:
        meta.version, meta.share = self.version, self.share
        await super().put_variant(meta)

    async def put_model(self, model: RegisteredModel) -> None:
        model.version = self.version
        await super().put_model(model)


class _OpRefused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class VersionKeeper:
    """Versions of tenants' tasks in ``catalog``'s etcd; blobs of deleted tasks collected from ``blobs``."""

    def __init__(self, catalog: Catalog, blobs: BlobStore, *, grace_s: float = 60.0) -> None:
        self.catalog, self.blobs, self.store = catalog, blobs, catalog.store
        self.grace_s = grace_s

    # -- the record ------------------------------------------------------------------------------------------
    async def read(self, task: str) -> tuple[VersionRecord | None, int]:
        """The task's record and its key's mod revision (0: none); an unreadable one is None (logged)."""
        item = await self.store.get(version_key(task))
        if item is None:
            return None, 0
        try:
            return VersionRecord.from_json(item.value), item.mod_revision
        except ValueError as exc:
            log.warning("unreadable version record of %r: %s", task, exc, extra=kv(task=task, event="versions_bad"))
            return None, item.mod_revision

    async def _write(self, record: VersionRecord, revision: int) -> bool:
        key = version_key(record.task)
        guard = CreateRevision(key, "==", 0) if revision == 0 else ModRevision(key, "==", revision)
        return bool((await self.store.txn([guard], [Put(key, record.to_json())])).succeeded)

    async def _update(self, task: str, change: Any) -> VersionRecord | None:
        """Apply ``change(record | None) -> record | None`` by CAS, retried a bounded number of times."""
        for _ in range(20):
            record, rev = await self.read(task)
            new = change(record)
            if new is None:
                return record
            if await self._write(new, rev):
                return new
        raise MeshError(f"the version record of task {task!r} kept changing: giving up", task=task)

    # -- builds ----------------------------------------------------------------------------------------------
    async def begin(self, tenant: str, task: str, family: str, min_accuracy: float | None = None) -> StampedCatalog:
        """Number a build of ``family`` and the catalog it writes through: share 0 while another version serves, or
        while the version has a bar to meet (``min_accuracy``, this registration's, or one declared before)."""
        numbered: list[int] = []
        seed = await self._seed(tenant, task)

        def change(rec: VersionRecord | None) -> VersionRecord:
            base = rec if rec is not None else seed
            v = next_version(base)
            numbered[:] = [v]
            return base.with_version(v, VersionInfo(family=family, state="building"))

        rec = await self._update(task, change)
        assert rec is not None
        version = numbered[0]
        waits = rec.active or min_accuracy is not None or rec.min_accuracy is not None
        return StampedCatalog(self.catalog, version, 0.0 if waits else 1.0)

    async def _seed(self, tenant: str, task: str) -> VersionRecord:
        """The record of a task registered before versions were kept: each registration its own version (its
        ``version`` field, 1 by default), the newest active."""
        rec = VersionRecord(task=task, owner=tenant)
        best: dict[str, float] = {}
        for m in await self.catalog.list_variants(task):
            best[m.family] = max(best.get(m.family, 0.0), m.accuracy)
        for model in await self.catalog.list_models(task):
            rec = rec.with_version(model.version, VersionInfo(model.family, "active", best.get(model.family, 0.0)))
        if rec.versions:
            newest = max(rec.versions)
            for v, i in rec.versions.items():
                if v != newest:
                    rec = rec.with_version(v, replace(i, state="held"))
            rec = rec.but(active=newest)
        return rec

    async def failed(self, task: str, version: int) -> None:
        """The build of ``version`` failed (its entries are already out): the active version stays."""
        def change(rec: VersionRecord | None) -> VersionRecord | None:
            if rec is None or version not in rec.versions:
                return None
            return rec.with_version(version, VersionInfo(rec.versions[version].family, "failed"))
        await self._update(task, change)

    async def finish(self, task: str, version: int, built: Sequence[VariantMeta],
                     min_accuracy: float | None = None) -> VersionRecord | None:
        """``version`` is built: active (traffic moves) when one variant meets the task's accuracy, else held
        (:func:`variant_store.versions.move_verdict`; its words are the version's ``note``). ``min_accuracy``: the bar
        this registration declared, the task's from now on (None: the one declared before, if any, stays)."""
        rec, _ = await self.read(task)
        if rec is None or version not in rec.versions:
            return rec
        if min_accuracy is not None:
            rec = rec.but(min_accuracy=min_accuracy)
        best = max((m.accuracy for m in built), default=0.0)
        moves, note = move_verdict(rec, version, best)

        def declared(r: VersionRecord) -> VersionRecord:
            return r if min_accuracy is None else r.but(min_accuracy=min_accuracy)

        if not moves:
            log.info("version %d of %s is below the task's accuracy (%s): held", version, task, note,
                     extra=kv(task=task, event="version_held"))

            def held(r: VersionRecord | None) -> VersionRecord | None:
                if r is None or version not in r.versions:
                    return None
                return declared(r).with_version(version, VersionInfo(r.versions[version].family, "held", best,
                                                                     note=note))
            new = await self._update(task, held)
            await self._set_share(task, version, 0.0)  # had the bar changed since begin, it was catalogued at share 1
            return new
        await self._set_share(task, version, 1.0)  # the new one up first: never a task with nothing to serve
        now = time.time()

        def moved(r: VersionRecord | None) -> VersionRecord | None:
            if r is None or version not in r.versions:
                return None
            out = declared(r).with_version(version, VersionInfo(r.versions[version].family, "active", best,
                                                                note=note))
            if r.active and r.active != version:
                out = out.with_version(r.active, replace(r.versions[r.active], state="retiring",
                                                         retire_at=now + self.grace_s))
            return out.but(active=version, weights={})
        new = await self._update(task, moved)
        await self._apply_shares(task, new)
        log.info("traffic of %s moved to version %d (%s)", task, version, note,
                 extra=kv(task=task, event="version_active"))
        return new

    # -- shares ----------------------------------------------------------------------------------------------
    async def _set_share(self, task: str, version: int, share: float) -> None:
        for m in await self.catalog.list_variants(task):
            if m.version == version and m.share != share:
                m.share = share
                await self.catalog.put_variant(m)

    async def _apply_shares(self, task: str, record: VersionRecord | None) -> None:
        """Mirror the record's shares into the catalog: rises first, then falls."""
        if record is None:
            return
        shares = shares_of(record)
        metas = await self.catalog.list_variants(task)
        changed = [m for m in metas if m.share != shares.get(m.version, 0.0)]
        for m in sorted(changed, key=lambda m: shares.get(m.version, 0.0) < m.share):
            m.share = shares.get(m.version, 0.0)
            await self.catalog.put_variant(m)

    # -- retirement ------------------------------------------------------------------------------------------
    async def retire_due(self, now: float | None = None) -> list[tuple[str, int]]:
        """Take out every retiring version whose grace is over (and no split names): (task, version) retired."""
        from mesh.etcd.keys import VERSIONS

        now = time.time() if now is None else now
        done: list[tuple[str, int]] = []
        for item in await self.store.get_prefix(VERSIONS):
            try:
                rec = VersionRecord.from_json(item.value)
            except ValueError:
                continue
            for v in due_retirements(rec, now):
                family = rec.versions[v].family
                try:
                    plan = await plan_removal(self.catalog, rec.task, family=family)
                    models = [m for m in await self.catalog.list_models(rec.task) if m.family == family]
                    await apply_removal(self.catalog, plan)
                    await self._collect(set(plan.digests) | {d for m in models
                                                             for d in (m.parent_digest, m.validation_digest)})
                except CatalogError:
                    pass  # already out (an operator removed it): retired all the same

                def retired(r: VersionRecord | None, v: int = v) -> VersionRecord | None:
                    if r is None or v not in r.versions or r.versions[v].state != "retiring":
                        return None
                    return r.with_version(v, replace(r.versions[v], state="retired", retire_at=0.0))
                await self._update(rec.task, retired)
                done.append((rec.task, v))
                log.info("version %d of %s retired", v, rec.task, extra=kv(task=rec.task, event="version_retired"))
        return done

    async def _collect(self, digests: set[str]) -> list[str]:
        """Remove from the blob store each of ``digests`` nothing names now (at once: see the module docstring)."""
        out = [d for d in await _unnamed(self.catalog, digests) if self.blobs.has(d)]
        for d in out:
            self.blobs.remove(d)
        return out

    # -- doors' requests -------------------------------------------------------------------------------------
    async def run_ops(self) -> int:
        """Answer every request doors wrote; returns how many were answered. Sweeps stale answers."""
        answered = 0
        now = time.time()
        for item in await self.store.get_prefix(MODEL_OPS):
            parts = item.key.split("/")
            try:
                op = ModelOp.from_json(item.value)
                if parts != ["modelops", op.tenant, op.op_id]:
                    raise ValueError("the request names another tenant or id than its key")
            except ValueError as exc:
                log.warning("unreadable model op at %s: %s", item.key[:120], exc, extra=kv(event="modelop_bad"))
                await self.store.delete(item.key)
                continue
            if op.state is not None:
                if now - op.created > ANSWER_TTL_S:
                    await self.store.delete(item.key)
                continue
            try:
                result = await (self._traffic(op) if op.op == "traffic" else self._delete(op))
                answer = ModelOp(**{**_fields(op), "state": "done", "result": result})
            except _OpRefused as exc:
                answer = ModelOp(**{**_fields(op), "state": "failed", "reason": exc.reason, "error": str(exc)})
            await self.store.txn([ModRevision(item.key, "==", item.mod_revision)], [Put(item.key, answer.to_json())])
            answered += 1
        return answered

    async def _owned(self, op: ModelOp) -> VersionRecord | None:
        """The task's record when ``op.tenant`` owns the task; ``not_found`` otherwise (as reads answer)."""
        rec, _ = await self.read(op.task)
        owners = {m.owner for m in await self.catalog.list_models(op.task)}
        owners |= {m.owner for m in await self.catalog.list_variants(op.task)}
        if rec is not None:
            owners.add(rec.owner)
        if not owners or owners != {op.tenant}:
            raise _OpRefused("not_found", f"no task {op.task!r} of tenant {op.tenant!r}")
        return rec

    async def _traffic(self, op: ModelOp) -> dict[str, Any]:
        rec = await self._owned(op)
        if rec is None:
            raise _OpRefused("bad_request", f"task {op.task!r} has no versions (register one first)")
        try:
            weights = normalise_weights(rec, op.weights)
        except ValueError as exc:
            raise _OpRefused("bad_request", str(exc)) from exc
        now = time.time()

        def split(r: VersionRecord | None) -> VersionRecord | None:
            if r is None:
                return None
            normalise_weights(r, weights)  # still servable now
            if len(weights) == 1:  # one version: it is the active one, the split ends, the others retire
                (only,) = weights
                out = r.but(active=only, weights={})
                for v, i in r.versions.items():
                    if v == only:
                        out = out.with_version(v, replace(i, state="active", retire_at=0.0))
                    elif i.state in ("active", "held", "retiring"):
                        at = i.retire_at if i.state == "retiring" else now + self.grace_s
                        out = out.with_version(v, replace(i, state="retiring", retire_at=at))
                return out
            return r.but(weights=weights)
        try:
            new = await self._update(op.task, split)
        except ValueError as exc:
            raise _OpRefused("conflict", str(exc)) from exc
        await self._apply_shares(op.task, new)
        assert new is not None
        return new.to_summary()

    async def _delete(self, op: ModelOp) -> dict[str, Any]:
        await self._owned(op)
        try:
            plan = await plan_removal(self.catalog, op.task)
        except CatalogError as exc:
            raise _OpRefused("not_found", str(exc)) from exc
        models = await self.catalog.list_models(op.task)
        await apply_removal(self.catalog, plan)
        await self.store.delete(version_key(op.task))
        collected = await self._collect(set(plan.digests) | {d for m in models
                                                             for d in (m.parent_digest, m.validation_digest)})
        log.info("task %s of %s deleted: %d keys, %d blobs collected", op.task, op.tenant, len(plan.keys),
                 len(collected), extra=kv(task=op.task, tenant=op.tenant, event="task_deleted"))
        return {"task": op.task, "deleted_keys": len(plan.keys), "collected_blobs": collected}


async def _unnamed(catalog: Catalog, digests: set[str]) -> list[str]:
    """The ``digests`` no catalog entry or registration names any more."""
    named = {d for m in await catalog.list_models() for d in (m.parent_digest, m.validation_digest, m.base_digest)}
    named |= {d for m in await catalog.list_variants() for d in (m.blob_digest, m.shared_base_digest)}
    return sorted(d for d in digests - named if d)


def _fields(op: ModelOp) -> dict[str, Any]:
    return {"op_id": op.op_id, "tenant": op.tenant, "task": op.task, "op": op.op, "weights": op.weights,
            "created": op.created}
