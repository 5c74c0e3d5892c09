"""The variant store runs tenants' model builds (issue 34 item 1): it claims the build requests doors wrote
(``builds/<tenant>/<id>``, ``edge_agent.models_api``), registers the parent as the tenant's own
(``variant_store.build.register_model(owner=tenant)``, which runs ``check_upload`` in a sandbox), generates and
measures the variants in a limited child (``build_task(sandbox=)``), and writes the state, progress and each
variant's results to ``buildstate/<id>``, the store's alone (``mesh.etcd.rbac``).

One build at a time: a build is CPU-bound (quantizers, profiling) on the machine that also serves blobs, and a
queue of them is cheaper than a fight over cores. Each step of a build is a compare-and-swap on its state record
(``mesh.buildspec.transition_ok``): a claim creates the record (or takes over one whose store died: untouched for
``stale_s``, kept fresh by a heartbeat while a build runs), and a store that lost its record (another claimed it)
stops writing. The inputs come from the store's own data area (where the door put them); nothing is fetched over
the network.

Refusals, each a ``failed`` state with a stable ``reason`` and a message for the tenant:

    reason            because
    task_owned        the task holds variants or models of another owner (public or another tenant)
    family_used       the family is another task's or already registered (``Catalog.check_family_free``)
    catalog           the model does not fit the task (other inputs than its first model), or another catalog rule
    bad_validation    the validation set is missing, unreadable or unlabelled
    missing_input     an input is not in the tenant's data area (a forged or a swept request)
    <check reason>    ``ModelRejected``'s (``variant_store.model_check``: custom_domain, op_not_allowed, ...)
    sandbox           generating or measuring failed in the child (crash, memory, CPU, time): the message says
    no_variant        nothing could be built (each kind's reason is in ``skipped``)
    unreadable        the request does not decode (nothing ran)

A failed build takes its registration out again (``variant_store.catalog_remove``), and the task's signature with
it when the build made the task: the family is free for the next try. The loop never dies: a round that fails is
logged and retried after a back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mesh.backoff import Backoff
from mesh.buildspec import (
    BuildRequest,
    BuildState,
    VariantResult,
    claimable,
    is_build_id,
    is_name,
    scan_validation,
    transition_ok,
)
from mesh.errors import CatalogError, MeshError, ModelRejected, ProtocolError, RequestError, VariantBuildError
from mesh.etcd.keys import BUILD_STATE, BUILDS, build_state_key
from mesh.etcd.ops import KV, CreateRevision, ModRevision, Put
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from variant_store.blobs import BlobStore
from variant_store.build import BATCH_SIZES, build_task, register_model
from variant_store.catalog import Catalog
from variant_store.catalog_remove import apply_removal, plan_removal
from variant_store.data_area import DataArea
from variant_store.meta import PUBLIC, VariantMeta
from variant_store.model_check import ModelLimits
from variant_store.sandbox import SandboxLimits
from variant_store.version_keeper import VersionKeeper

__all__ = ["BuildOptions", "TenantBuilder"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """How the store builds tenants' models. ``kinds``: the variant kinds to generate (None: every kind this
    machine can); ``sandbox``: the child's limits for generating and measuring one model."""

    kinds: tuple[str, ...] | None = None
    repeats: int = 20
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    sandbox: SandboxLimits = field(default_factory=lambda: SandboxLimits(cpu_seconds=600, wall_seconds=900))
    model_limits: ModelLimits | None = None
    max_validation_bytes: int = 256 << 20
    poll_s: float = 1.0
    stale_s: float = 600.0
    retire_grace_s: float = 60.0  # an old version leaves the catalog this long after traffic moved off it


class _Lost(Exception):
    """Another store claimed the build: stop writing its state."""


class _Failed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Record:
    """The state record of one build this store runs: each write a CAS on the revision last written."""

    def __init__(self, builder: TenantBuilder, state: BuildState, revision: int) -> None:
        self.builder, self.state, self.revision = builder, state, revision
        self._lock = asyncio.Lock()

    async def write(self, **changes: Any) -> None:
        async with self._lock:
            new = self.state.but(updated=time.time(), **changes)
            if not transition_ok(self.state, new):
                raise _Lost(f"build {new.build_id}: {self.state.state} -> {new.state} is not allowed")
            key = build_state_key(new.build_id)
            res = await self.builder.store.txn([ModRevision(key, "==", self.revision)], [Put(key, new.to_json())])
            if not res.succeeded:
                raise _Lost(f"build {new.build_id} was claimed by another store")
            self.state, self.revision = new, res.revision  # a txn's put lands at the revision it reports


def _results(metas: list[VariantMeta]) -> tuple[VariantResult, ...]:
    return tuple(VariantResult(variant=m.variant_id, format=m.format, precision=m.precision, accuracy=m.accuracy,
                               size_bytes=m.size_bytes,
                               latency_ms={hw: {b: s.p50_ms for b, s in p.latency.items()}
                                           for hw, p in m.profiles.items()})
                 for m in metas)


class TenantBuilder(Service):
    """Claims and runs the build requests in ``catalog``'s etcd, one at a time, with the inputs in ``data``."""

    def __init__(self, catalog: Catalog, blobs: BlobStore, data: DataArea, *, options: BuildOptions | None = None,
                 name: str = "store") -> None:
        self.catalog, self.blobs, self.data = catalog, blobs, data
        self.store = catalog.store
        self.options = options or BuildOptions()
        self.worker = f"{name}:{uuid.uuid4().hex[:8]}"
        self.builds_run = 0
        self._task: asyncio.Task[None] | None = None
        self._versions_task: asyncio.Task[None] | None = None
        self._reported: set[str] = set()  # unreadable keys already logged
        # versions of tenants' tasks (issue 34 item 3): its own loop, so a long build never holds up a door's
        # traffic split or delete, nor a retirement
        self.versions = VersionKeeper(catalog, blobs, grace_s=self.options.retire_grace_s)

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name="tenant-builds")
        self._versions_task = loop.create_task(self._versions_loop(), name="tenant-versions")

    async def _stop(self) -> None:
        task, self._task = self._task, None
        versions, self._versions_task = self._versions_task, None
        await cancel_and_wait(task)
        await cancel_and_wait(versions)

    async def _versions_loop(self) -> None:
        backoff = Backoff(self.options.poll_s, 30.0)
        while True:
            try:
                await self.versions.run_ops()
                await self.versions.retire_due()
                backoff.reset()
                await asyncio.sleep(min(self.options.poll_s, 0.5))
            except Exception:  # the loop never dies: log, back off, go on
                log.exception("tenant versions round failed", extra=kv(event="versions_round_failed"))
                await asyncio.sleep(backoff.next())

    async def _loop(self) -> None:
        backoff = Backoff(self.options.poll_s, 30.0)
        while True:
            try:
                ran = await self.run_once()
                backoff.reset()
                if ran:
                    continue  # another may be queued behind it
                await asyncio.sleep(self.options.poll_s)
            except Exception:  # the loop never dies: log, back off, go on
                log.exception("tenant build round failed", extra=kv(event="build_round_failed"))
                await asyncio.sleep(backoff.next())

    async def run_once(self) -> bool:
        """Claim and run the oldest build that is claimable; whether one ran."""
        requests = await self.store.get_prefix(BUILDS)
        states = {item.key[len(BUILD_STATE):]: item for item in await self.store.get_prefix(BUILD_STATE)}
        now = time.time()
        todo: list[tuple[float, BuildRequest, KV | None]] = []
        for item in requests:
            parts = item.key.split("/")
            got = states.get(parts[-1])
            try:
                req = BuildRequest.from_json(item.value)
                if parts != ["builds", req.tenant, req.build_id]:
                    raise ProtocolError(f"the request names tenant {req.tenant!r} and build {req.build_id}")
                old = BuildState.from_json(got.value) if got is not None else None
            except ProtocolError as exc:
                if got is None and len(parts) == 3 and is_name(parts[1]) and is_build_id(parts[2]):
                    await self._refuse_unreadable(parts[1], parts[2], str(exc))
                elif item.key not in self._reported:
                    self._reported.add(item.key)
                    log.warning("unreadable build at %s: %s", item.key[:120], exc, extra=kv(event="build_unreadable"))
                continue
            if claimable(old, now, self.options.stale_s):
                todo.append((req.created, req, got))
        for _, req, got in sorted(todo, key=lambda t: t[0]):
            record = await self._claim(req, got)
            if record is not None:
                await self._run(req, record)
                return True
        return False

    async def _refuse_unreadable(self, tenant: str, build_id: str, why: str) -> None:
        key = build_state_key(build_id)
        st = BuildState(build_id, tenant, "failed", error=f"the build request cannot be read: {why}",
                        reason="unreadable", worker=self.worker, started=time.time(), updated=time.time())
        await self.store.txn([CreateRevision(key, "==", 0)], [Put(key, st.to_json())])

    async def _claim(self, req: BuildRequest, got: KV | None) -> _Record | None:
        key = build_state_key(req.build_id)
        now = time.time()
        st = BuildState(req.build_id, req.tenant, "running", stage="claimed", progress=0.01, worker=self.worker,
                        started=now, updated=now)
        guard = CreateRevision(key, "==", 0) if got is None else ModRevision(key, "==", got.mod_revision)
        res = await self.store.txn([guard], [Put(key, st.to_json())])
        if not res.succeeded:
            return None  # another store claimed it first
        record = _Record(self, st, res.revision)
        log.info("build %s claimed: %s/%s of %s", req.build_id, req.task, req.family, req.tenant,
                 extra=kv(event="build_claimed", tenant=req.tenant, task=req.task, build=req.build_id))
        return record

    async def _run(self, req: BuildRequest, record: _Record) -> None:
        beat = asyncio.get_running_loop().create_task(self._heartbeat(record), name=f"build-beat:{req.build_id[:8]}")
        try:
            try:
                await self._build(req, record)
            except _Failed as exc:
                await record.write(state="failed", reason=exc.reason, error=str(exc), stage="failed")
                log.info("build %s failed (%s): %s", req.build_id, exc.reason, exc,
                         extra=kv(event="build_failed", tenant=req.tenant, task=req.task, reason=exc.reason))
        except _Lost as exc:
            log.warning("%s", exc, extra=kv(event="build_lost", build=req.build_id))
        finally:
            await cancel_and_wait(beat)
            self.builds_run += 1

    async def _heartbeat(self, record: _Record) -> None:
        every = max(1.0, self.options.stale_s / 4)
        while True:
            await asyncio.sleep(every)
            try:
                await record.write()
            except _Lost:
                return
            except MeshError as exc:  # etcd hiccup: the next beat tries again
                log.info("build heartbeat failed: %s", exc, extra=kv(event="build_beat_failed"))

    async def _owner_conflict(self, req: BuildRequest) -> str | None:
        if req.tenant == PUBLIC:
            return "the public catalog is registered by operators, not through a tenant's build"
        owners = {m.owner for m in await self.catalog.list_variants(req.task)}
        owners |= {m.owner for m in await self.catalog.list_models(req.task)}
        others = sorted(owners - {req.tenant})
        if not others:
            return None
        who = "the public catalog" if PUBLIC in others else "another tenant"
        return f"task {req.task!r} belongs to {who}: a tenant may add models only to its own private tasks"

    async def _build(self, req: BuildRequest, record: _Record) -> None:
        opts = self.options
        await record.write(stage="fetching", progress=0.05)
        try:
            model_path = self.data.path(req.tenant, req.model_digest)
            val_path = self.data.path(req.tenant, req.validation_digest)
        except RequestError as exc:
            raise _Failed("missing_input", str(exc)) from exc
        for what, p in (("model", model_path), ("validation set", val_path)):
            if not p.is_file():
                raise _Failed("missing_input", f"the {what} ({p.name[:12]}) is not in tenant {req.tenant!r}'s data")
        why = await self._owner_conflict(req)
        if why is not None:
            raise _Failed("task_owned", why)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, scan_validation, val_path, opts.max_validation_bytes)
        except RequestError as exc:
            raise _Failed("bad_validation", str(exc)) from exc
        await record.write(stage="checking", progress=0.1)
        task_was_new = req.task not in await self.catalog.list_tasks()
        with contextlib.suppress(CatalogError):  # absent (or unreadable): register_model decides
            await self.catalog.get_model(req.task, req.family)
            raise _Failed("family_used", f"family {req.family!r} is already registered for task {req.task!r}: "
                          f"register the model under a new family name")
        # version N+1, share 0 while N serves or while a declared bar is to be met
        stamped = await self.versions.begin(req.tenant, req.task, req.family, req.min_accuracy)
        try:
            try:
                await register_model(stamped, self.blobs, model_path, val_path, req.task, req.family,
                                     owner=req.tenant, limits=opts.model_limits)
            except ModelRejected as exc:
                raise _Failed(str(exc.details.get("reason") or "bad_model"), str(exc)) from exc
            except CatalogError as exc:
                used = "family" in str(exc) and ("holds" in str(exc) or "used" in str(exc) or
                                                 "registered" in str(exc))
                raise _Failed("family_used" if used else "catalog", str(exc)) from exc
            except VariantBuildError as exc:
                raise _Failed("bad_validation", str(exc)) from exc
            try:
                await record.write(stage="building", progress=0.3)
                report = await build_task(stamped, self.blobs, req.task, families=[req.family],
                                          kinds=list(opts.kinds) if opts.kinds is not None else None, progress=False,
                                          repeats=opts.repeats, batch_sizes=opts.batch_sizes, sandbox=opts.sandbox)
                skipped = tuple((s.kind, s.reason[:1000]) for s in report.skipped)
                if not report.built:
                    sandbox = any(k == "*" for k, _ in skipped)
                    raise _Failed("sandbox" if sandbox else "no_variant",
                                  "; ".join(f"{k}: {r}" for k, r in skipped)[:3000] or "no variant could be built")
                # traffic moves to it when it meets the task's accuracy (variant_store.version_keeper) before the
                # build says done: a tenant that waited for the build finds the version already active (or held),
                # and the done state says which and why
                outcome = await self.versions.finish(req.task, stamped.version, report.built, req.min_accuracy)
            except BaseException:
                with contextlib.suppress(Exception):  # the family is free again for the next try
                    await self._unregister(req, task_was_new)
                raise
        except BaseException:
            with contextlib.suppress(Exception):  # version N stays active
                await self.versions.failed(req.task, stamped.version)
            raise
        info = outcome.versions.get(stamped.version) if outcome is not None else None
        state, note = (info.state, info.note) if info is not None else ("", "")
        await record.write(state="done", stage="done", progress=1.0, variants=_results(report.built), skipped=skipped,
                           version=stamped.version, version_state=state if state in ("active", "held") else "",
                           version_note=note)
        log.info("build %s done: %d variants of %s/%s for %s (version %d, %s)", req.build_id, len(report.built),
                 req.task, req.family, req.tenant, stamped.version, state or "state unknown",
                 extra=kv(event="build_done", tenant=req.tenant, task=req.task, build=req.build_id))

    async def _unregister(self, req: BuildRequest, task_was_new: bool) -> None:
        await apply_removal(self.catalog, await plan_removal(self.catalog, req.task, family=req.family))
        if task_was_new and not await self.catalog.list_models(req.task):
            with contextlib.suppress(CatalogError):
                await apply_removal(self.catalog, await plan_removal(self.catalog, req.task))

