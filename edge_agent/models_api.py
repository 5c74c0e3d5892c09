"""The edge's model registration REST API (issue 34 item 1): a tenant registers its own model over its own identity
(the client certificate's, as for inference; without TLS the tenant header), and the variant store builds it as
tracked work (``variant_store.tenant_builds``).

    POST /v2/models/{task}/versions?family=F[&min_accuracy=A]
         multipart/form-data with two parts, each a file: ``model`` (the parent ONNX model) and ``validation`` (an
         NPZ with ``x``, one row per example, and ``y``, integer labels; optional ``calib_count``: rows before it
         calibrate INT8 and are never scored); 202 {"id", "state": "queued", ...} once both are stored.
         ``min_accuracy`` (in [0, 1]) declares the task's accuracy bar: this version, and every later one until
         another declaration, takes traffic only when one of its variants meets it (``variant_store.versions``);
         the build's status says whether its version became ``active`` or was ``held``, and why
    GET  /v2/models/{task}/builds                   the caller's builds of the task
    GET  /v2/builds                                 the caller's builds
    GET  /v2/models/{task}/builds/{id}              state, stage, progress, each variant's accuracy, size and p50
                                                    latency per batch size per hardware class (the store's at first,
                                                    every class that profiled it once sites have), error and reason
    GET|PUT|DELETE  /v2/models/{task}/versions, /v2/models/{task}/traffic, /v2/models/{task}: a task's versions,
                                                    its traffic split, deleting it (``edge_agent.model_versions``)
    GET  /v2/models/{task}/builds/{id}?wait=S&since=R   the same as a long poll: answered once the build changed
                                                    after revision R (a status's ``revision``; default now), or after
                                                    S seconds (at most 60), or at once when it is finished

A tenant sees only its own builds (another's id is a 404, as an unknown one). Admission, in order, before a byte of the
body is read: an unknown tenant (403), a task or family name that is not ``[A-Za-z0-9][A-Za-z0-9_-]*``, or a
``min_accuracy`` that is not a number in [0, 1] (400), a task holding another owner's variants or models (public or
another tenant's: 403, a tenant adds only to its own private tasks, new or existing), a task another tenant is
registering now (409), a family used by another task, or registered already, or being built (409); then each part is
streamed to a spool file (hashed as it arrives, never whole in memory; over ``max_model_bytes`` /
``max_validation_bytes``: 413), the model checked in a sandboxed child (``variant_store.model_check.check_upload``: 422
with its ``reason``; the store checks it again before building), the validation set scanned without trusting it
(``mesh.buildspec.scan_validation``: 400), both stored in the tenant's data area (content-addressed; over the tenant's
quota: 413 naming it), then the build request in etcd (``core_scheduler.state.builds``). Two registrations racing for
one new task or family both pass the door; the store builds one at a time and refuses the second (``task_owned`` /
``family_used``).

The admission rules and the steps after spooling are :mod:`edge_agent.model_register`'s, shared with the gRPC front's
``RepositoryModelLoad`` (``tritonclient.grpc``'s ``load_model``): one definition of each rule and error for both.

An input stored before a later refusal (the validation set over quota after the model was stored) stays in the data
area until retention collects it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import BodyPartReader, web

from core_scheduler.state.builds import BuildBook, BuildView
from core_scheduler.state.view import MeshView
from edge_agent.job_follow import since_of, wait_s_of
from edge_agent.model_register import Registrar, Spooled
from edge_agent.model_versions import ModelVersions
from mesh.buildspec import is_build_id
from mesh.errors import PayloadTooLarge, QuotaExceeded, RequestError
from variant_store.catalog import Catalog
from variant_store.data_client import DataClient
from variant_store.sandbox import SandboxLimits

if TYPE_CHECKING:
    from variant_store.model_check import ModelLimits

__all__ = ["ModelsApi"]

PARTS = ("model", "validation")
Route = tuple[str, str, Callable[[web.Request], Any]]


class _NoBuild(RequestError):
    """An unknown build, or another tenant's: 404 either way (the code stays ``bad_request``)."""

    http_status = 404


class ModelsApi:
    """The model routes of the door at ``site``. ``who(request)``: the caller's tenant (as inference's)."""

    def __init__(self, site: str, view: MeshView, builds: BuildBook, catalog: Catalog, data: DataClient,
                 spool: Path, who: Callable[[web.Request], str], *, model_limits: ModelLimits | None = None,
                 max_validation_bytes: int = 256 << 20, check_sandbox: SandboxLimits | None = None,
                 checks: int = 2, waits_per_tenant: int = 8) -> None:
        self.view, self.builds, self.who = view, builds, who
        # the registration's rules and steps, shared with the gRPC front (edge_agent.model_register)
        self.registrar = Registrar(site, view, builds, catalog, data, spool, model_limits=model_limits,
                                   max_validation_bytes=max_validation_bytes, check_sandbox=check_sandbox,
                                   checks=checks)
        self.waits_per_tenant = waits_per_tenant
        self._waiting: dict[str, int] = {}
        self._closing = asyncio.Event()
        # a task's versions, traffic split and delete (issue 34 item 3)
        self.versions = ModelVersions(builds.store, self._tenant)

    async def close(self) -> None:
        """End the long polls now (the door is stopping)."""
        self._closing.set()

    def routes(self) -> list[Route]:
        return [("POST", "/v2/models/{task}/versions", self.register),
                ("GET", "/v2/models/{task}/builds", self.list_task), ("GET", "/v2/builds", self.list_all),
                ("GET", "/v2/models/{task}/builds/{build}", self.show), *self.versions.routes()]

    # -- admission --------------------------------------------------------------------------------------------
    def _tenant(self, request: web.Request) -> str:
        return self.registrar.tenant(self.who(request))

    async def register(self, request: web.Request) -> web.Response:
        reg = self.registrar
        q = request.query
        admitted = await reg.admit(self.who(request), request.match_info["task"], q.get("family", ""),
                                   q.get("min_accuracy"))
        limit = reg.max_model_bytes + reg.max_validation_bytes + (1 << 20)
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(f"a registration of {request.content_length} bytes is over this door's {limit}",
                                  limit=limit)
        if not request.content_type.startswith("multipart/"):
            raise RequestError("send multipart/form-data with two file parts, 'model' (ONNX) and 'validation' (NPZ)")
        spooled: dict[str, Spooled] = {}
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                name = str(getattr(part, "name", None))
                if not isinstance(part, BodyPartReader) or name not in PARTS or name in spooled:
                    raise RequestError(f"unexpected part {name[:40]!r}: send exactly one 'model' and one "
                                       f"'validation'")
                spooled[name] = await reg.spool_chunks(name, _chunks(part))
            missing = [p for p in PARTS if p not in spooled]
            if missing:
                raise RequestError(f"missing part(s) {missing}: send 'model' (ONNX) and 'validation' (NPZ)")
        except BaseException:
            for s in spooled.values():
                with contextlib.suppress(FileNotFoundError):
                    s.path.unlink()
            raise
        admitted_build = await reg.register(admitted, spooled["model"], spooled["validation"])
        return web.json_response(admitted_build, status=202)

    # -- reading ----------------------------------------------------------------------------------------------
    async def _mine(self, request: web.Request, tenant: str) -> BuildView:
        build_id, task = request.match_info["build"], request.match_info["task"]
        v = await self.builds.view(tenant, build_id) if is_build_id(build_id) else None
        if v is None or v.request.task != task:
            raise _NoBuild(f"no build {build_id[:40]!r} of task {task!r}")
        return v

    def _status(self, v: BuildView, revision: int) -> dict[str, Any]:
        """The build's status, each variant's latency taken from the catalog now (sites add their classes)."""
        out = v.to_json()
        catalogued = self.view.variants.get(v.request.task) or {}
        for r in out["variants"]:
            meta = catalogued.get(r["variant"])
            r["catalogued"] = meta is not None
            if meta is not None:
                r["latency_ms"] = {hw: {str(b): s.p50_ms for b, s in sorted(p.latency.items())}
                                   for hw, p in sorted(meta.profiles.items())}
        out["revision"] = revision
        return out

    async def show(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        q = request.query
        wait_s, since = wait_s_of(q.get("wait", "0")), since_of(q.get("since"))
        rev = await self.builds.store.revision()  # before the read: a watch from the next one misses nothing
        v = await self._mine(request, tenant)
        if wait_s > 0 and not v.terminal:
            with self._slot(tenant):
                if await self._wait(v.request.build_id, rev if since is None else min(since, rev), wait_s):
                    rev = await self.builds.store.revision()
                    v = await self._mine(request, tenant)
        return web.json_response(self._status(v, rev))

    @contextlib.contextmanager
    def _slot(self, tenant: str) -> Iterator[None]:
        if self._closing.is_set() or self._waiting.get(tenant, 0) >= self.waits_per_tenant:
            raise QuotaExceeded(f"tenant {tenant!r} holds {self._waiting.get(tenant, 0)} build long polls at this "
                                f"door (at most {self.waits_per_tenant}), or the door is stopping: poll",
                                retry_after_s=1)
        self._waiting[tenant] = self._waiting.get(tenant, 0) + 1
        try:
            yield
        finally:
            self._waiting[tenant] -= 1
            if not self._waiting[tenant]:
                del self._waiting[tenant]

    async def _wait(self, build_id: str, after: int, wait_s: float) -> bool:
        changed = asyncio.ensure_future(self.builds.wait_change(build_id, after, wait_s))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({changed, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (changed, closing):
                f.cancel()
            await asyncio.gather(changed, closing, return_exceptions=True)
        return changed.done() and not changed.cancelled() and changed.exception() is None and changed.result()

    async def _list(self, request: web.Request, task: str | None) -> web.Response:
        tenant = self._tenant(request)
        views = [v for v in await self.builds.views(tenant) if task is None or v.request.task == task]
        return web.json_response({"builds": [
            {k: s[k] for k in ("id", "task", "family", "state", "stage", "progress", "created", "updated", "error",
                               "reason")} for s in (v.to_json() for v in views)]})

    async def list_task(self, request: web.Request) -> web.Response:
        return await self._list(request, request.match_info["task"])

    async def list_all(self, request: web.Request) -> web.Response:
        return await self._list(request, None)


async def _chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(1 << 16):
        yield chunk
