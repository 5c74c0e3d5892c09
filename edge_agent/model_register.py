"""A tenant's model registration, whatever door it came through (issue 34): the REST front
(:mod:`edge_agent.models_api`, a multipart upload streamed to the spool) and the gRPC front
(:mod:`edge_agent.grpc_api`, Triton's ``RepositoryModelLoad``, the files whole in one message) parse their request
and call the same two steps here, so every admission rule and every error is defined once:

    admit(tenant, task, family, min_accuracy)    -> Admitted    before a byte of the inputs is read (REST) or used
    register(admitted, model, validation)        -> dict        the admitted build's status (REST's 202 body)

``admit``, in order: an unknown tenant (``UnknownTenant``), a task or family name that is not
``[A-Za-z0-9][A-Za-z0-9_-]*`` or a ``min_accuracy`` that is not a number in [0, 1] (``RequestError``), the public
tenant, or a task holding another owner's variants or models (``PermissionDenied``), a task another tenant is
registering now, a family in use, registered already or being built (``ConflictError``). ``register``: each input
spooled (a :class:`Spooled` file as the REST front streamed it, or bytes written out here; over its cap:
``PayloadTooLarge``; empty: ``RequestError``), the model checked in a sandboxed child (``ModelRejected`` with its
``reason``), the validation set scanned without trusting it (``RequestError``), both stored in the tenant's data
area (over its quota: ``PayloadTooLarge`` naming it), then the build request in etcd. The spool files are removed
whatever the outcome.

The gRPC request's own parsing (:func:`load_request`) is here too, beside the rules it feeds: Triton's
``load_model(task, config=json.dumps({"family": F, "min_accuracy": A}), files={"file:model.onnx": ...,
"file:validation.npz": ...})``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core_scheduler.state.builds import BuildBook
from core_scheduler.state.view import MeshView
from mesh.buildspec import BuildRequest, declared_accuracy, is_name, scan_validation
from mesh.errors import (
    CatalogError,
    ConflictError,
    ModelRejected,
    PayloadTooLarge,
    PermissionDenied,
    RequestError,
    UnknownTenant,
)
from mesh.log import get_logger, kv
from variant_store.catalog import Catalog
from variant_store.data_client import DataClient
from variant_store.meta import PUBLIC
from variant_store.sandbox import SandboxLimits

if TYPE_CHECKING:
    from mesh.v2.grpc_messages import RepositoryModelLoadRequest
    from variant_store.model_check import ModelLimits

__all__ = ["BUILD_ID_KEY", "FILES", "MAX_MODEL_BYTES", "Admitted", "LoadRequest", "Registrar", "Source", "Spooled",
           "load_request"]

log = get_logger(__name__)
MAX_MODEL_BYTES = 256 << 20  # ModelLimits' default (variant_store.model_check, imported at the first upload: onnx)
BUILD_ID_KEY = "tiermesh-build-id"  # the gRPC reply's metadata (initial and trailing) naming the admitted build
FILES = {"model": "file:model.onnx", "validation": "file:validation.npz"}  # input -> its RepositoryModelLoad key
_CONFIG_KEYS = {"family", "min_accuracy"}


@dataclass(frozen=True, slots=True)
class Spooled:
    """An input on disk in the spool: its path, sha256 and size (the REST front streams each part to one)."""

    path: Path
    digest: str
    size: int


Source = Spooled | bytes


@dataclass(frozen=True, slots=True)
class Admitted:
    """A registration that passed :meth:`Registrar.admit`: a known tenant, valid names, a bar in [0, 1] or None."""

    tenant: str
    task: str
    family: str
    min_accuracy: float | None


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """A ``RepositoryModelLoad`` read as a registration (names and bar not yet admitted)."""

    task: str
    family: str
    min_accuracy: str | None  # as REST's query parameter: declared_accuracy checks it, once
    model: bytes
    validation: bytes


class Registrar:
    """The registrations admitted at the door of ``site``; arguments as :class:`edge_agent.models_api.ModelsApi`'s."""

    def __init__(self, site: str, view: MeshView, builds: BuildBook, catalog: Catalog, data: DataClient,
                 spool: Path, *, model_limits: ModelLimits | None = None, max_validation_bytes: int = 256 << 20,
                 check_sandbox: SandboxLimits | None = None, checks: int = 2) -> None:
        self.site, self.view, self.builds, self.catalog, self.data = site, view, builds, catalog, data
        self.spool = spool
        self.model_limits = model_limits  # None: the check's defaults
        self.max_model_bytes = model_limits.max_file_bytes if model_limits is not None else MAX_MODEL_BYTES
        self.max_validation_bytes = max_validation_bytes
        self.check_sandbox = check_sandbox or SandboxLimits(cpu_seconds=60, wall_seconds=90)
        self._checks = asyncio.Semaphore(checks)  # sandboxed checks at once: each is a child process

    def cap(self, name: str) -> int:
        """The most bytes input ``name`` (``model`` or ``validation``) may have."""
        return self.max_model_bytes if name == "model" else self.max_validation_bytes

    # -- admission --------------------------------------------------------------------------------------------
    def tenant(self, tenant: str) -> str:
        if tenant not in self.view.tenants:
            raise UnknownTenant(f"tenant {tenant!r} is not in the topology")
        return tenant

    async def admit(self, tenant: str, task: str, family: str, min_accuracy: str | None) -> Admitted:
        self.tenant(tenant)
        for what, name in (("task", task), ("family", family)):
            if not is_name(name):
                raise RequestError(f"{what} name {name[:60]!r} must be 1-128 of letters, digits, '_' and '-', "
                                   f"starting with a letter or digit (pass ?family=NAME)")
        admitted = Admitted(tenant, task, family, declared_accuracy(min_accuracy))
        await self._admissible(tenant, task, family)
        return admitted

    async def _admissible(self, tenant: str, task: str, family: str) -> None:
        if tenant == PUBLIC:  # its variants would be everyone's: the public catalog is the operators'
            raise PermissionDenied("the public catalog is registered by operators (tiermesh variants register), "
                                   "not through the edge", reason="public")
        owners = {m.owner for m in (self.view.variants.get(task) or {}).values()}
        owners |= {m.owner for m in await self.catalog.list_models(task)}
        if owners - {tenant}:
            raise PermissionDenied(f"task {task!r} is not yours: a tenant may add models only to its own private "
                                   f"tasks (new or existing); pick another task name", reason="task_owned")
        live = [v.request for v in await self.builds.views() if v.live]
        if any(r.task == task and r.tenant != tenant for r in live):
            raise ConflictError(f"task {task!r} is being registered by another tenant: pick another task name")
        try:
            await self.catalog.check_family_free(task, family)
        except CatalogError as exc:
            raise ConflictError(str(exc), family=family) from exc
        if any(m.family == family for m in await self.catalog.list_models(task)):
            raise ConflictError(f"family {family!r} is already registered for task {task!r}: register the model "
                                f"under a new family name", family=family)
        if any(r.family == family for r in live):
            raise ConflictError(f"family {family!r} is being built already: wait for that build, or pick another "
                                f"family name", family=family)

    # -- the inputs -------------------------------------------------------------------------------------------
    async def spool_chunks(self, name: str, chunks: AsyncIterator[bytes]) -> Spooled:
        """Input ``name`` on disk, hashed as it arrives, at most :meth:`cap` bytes; removed again on any error."""
        self.spool.mkdir(parents=True, exist_ok=True)
        cap = self.cap(name)
        fd, tmp = tempfile.mkstemp(prefix=f"{name}-", dir=self.spool)
        h, size = hashlib.sha256(), 0
        loop = asyncio.get_running_loop()
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > cap:
                        raise PayloadTooLarge(f"the {name} is over this door's {cap} bytes", limit=cap, part=name)
                    h.update(chunk)
                    await loop.run_in_executor(None, f.write, chunk)
            if size == 0:
                raise RequestError(f"the {name} part is empty")
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return Spooled(Path(tmp), h.hexdigest(), size)

    async def _spooled(self, name: str, source: Source) -> Spooled:
        if isinstance(source, Spooled):
            return source

        async def whole() -> AsyncIterator[bytes]:
            yield source

        return await self.spool_chunks(name, whole())

    # -- the one registration ---------------------------------------------------------------------------------
    async def register(self, admitted: Admitted, model: Source, validation: Source) -> dict[str, Any]:
        """Check and store both inputs, then request the build; its status as admitted (``id``, ``state``,
        ``rows``, the model's summary). Spool files, given or written here, are removed."""
        sources = {"model": model, "validation": validation}
        spooled = {n: s for n, s in sources.items() if isinstance(s, Spooled)}
        try:
            for name, source in sources.items():
                spooled[name] = await self._spooled(name, source)
            m, v = spooled["model"], spooled["validation"]
            # imported here, not at the top: an agent that never sees an upload does not load onnx (its start is
            # measured: tests/unit/test_extras.py)
            from variant_store.model_check import check_upload

            async with self._checks:
                try:
                    summary = await check_upload(m.path, self.model_limits, sandbox=self.check_sandbox)
                except ModelRejected as exc:  # the reason word in the text too: a client may show only that
                    reason = str(exc.details.get("reason") or "bad_model")
                    raise ModelRejected(f"the model is refused ({reason}): {exc.message}", **exc.details) from exc
            rows = (await asyncio.get_running_loop().run_in_executor(
                None, scan_validation, v.path, self.max_validation_bytes)).rows
            await self.data.put_file(admitted.tenant, m.digest, m.path)
            await self.data.put_file(admitted.tenant, v.digest, v.path)
        finally:
            for s in spooled.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(s.path)
        tenant, task, family = admitted.tenant, admitted.task, admitted.family
        req = BuildRequest(build_id=uuid.uuid4().hex, tenant=tenant, task=task, family=family,
                           model_digest=m.digest, model_bytes=m.size, validation_digest=v.digest,
                           validation_bytes=v.size, rows=rows, door=self.site, created=time.time(),
                           min_accuracy=admitted.min_accuracy)
        await self.builds.create(req)
        log.info("build %s admitted: %s/%s", req.build_id, task, family,
                 extra=kv(tenant=tenant, event="build_admitted", task=task, build=req.build_id, size=m.size))
        return {"id": req.build_id, "task": task, "family": family, "state": "queued", "rows": rows,
                "min_accuracy": admitted.min_accuracy,
                "model": {"nodes": summary.nodes, "opset": summary.opset, "bytes": summary.file_bytes}}


# -- the gRPC door's request ----------------------------------------------------------------------------------------
def _config(raw: object) -> tuple[str, str | None]:
    """``config``: a JSON object ``{"family": F, "min_accuracy": A}`` (the bar optional) -> (family, bar as text)."""
    usage = 'config must be a JSON object {"family": NAME, "min_accuracy": A (optional, in [0, 1])}'
    if not isinstance(raw, str):
        raise RequestError(f"{usage}: pass load_model(task, config=json.dumps({{...}}), files=...)")
    try:
        cfg = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"{usage}, not JSON: {exc}"[:300]) from exc
    if not isinstance(cfg, dict) or not isinstance(cfg.get("family"), str) or set(cfg) - _CONFIG_KEYS:
        raise RequestError(f"{usage}; got {raw[:80]!r}")
    bar = cfg.get("min_accuracy")
    if bar is not None and (type(bar) not in (int, float, str)):
        raise RequestError(f"{usage}; min_accuracy is {type(bar).__name__}")
    return cfg["family"], None if bar is None else str(bar)


def load_request(msg: RepositoryModelLoadRequest) -> LoadRequest:
    """A ``RepositoryModelLoad`` as a registration: ``model_name`` the task, the ``config`` string parameter, the
    two files as bytes parameters (``FILES``); ``RequestError`` naming what is missing or unexpected."""
    params = {e.key: e.value for e in msg.parameters}
    unexpected = sorted(set(params) - {"config", *FILES.values()})
    if unexpected:
        raise RequestError(f"unexpected parameter(s) {[k[:40] for k in unexpected[:5]]}: send config and the files "
                           f"{list(FILES.values())}")
    cfg = params.get("config")
    family, bar = _config(cfg.string_param if cfg is not None else None)
    files = {n: None if (p := params.get(k)) is None else p.bytes_param for n, k in FILES.items()}
    missing = [FILES[n] for n, data in files.items() if data is None]
    if missing:
        raise RequestError(f"missing file(s) {missing}: send files={{'file:model.onnx': <ONNX bytes>, "
                           f"'file:validation.npz': <NPZ bytes>}}")
    return LoadRequest(msg.model_name, family, bar, files["model"] or b"", files["validation"] or b"")
