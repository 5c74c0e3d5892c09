"""The edge's offline-job REST API (a door's; the work itself is ``edge_agent.chunks``', whose docstring lists what
of issue 32 is not built yet):

    POST   /v2/models/{task}/jobs?min_accuracy=&deadline_s=&max_cost=&format=npz|jsonl|oip&chunk_rows=&fresh=&notify=
           the body is the input (NPZ with ``x``, JSON lines, or OIP binary tensors); 202 {"id", ...} once it is
           stored; ``notify``: an https URL under one the operator allowed the tenant (``mesh.webhooks``; 400
           otherwise), POSTed once the job ends (``core_scheduler.job_notify``)
    GET    /v2/models/{task}/jobs            the caller's jobs of the task
    GET    /v2/jobs                          the caller's jobs
    GET    /v2/models/{task}/jobs/{id}       state, progress, rows done, sites, the etcd revision read at
    GET    /v2/models/{task}/jobs/{id}?wait=S&since=R   the same as a long poll (``edge_agent.job_follow``)
    GET    /v2/models/{task}/jobs/{id}/events           the same as Server-Sent Events until the job ends
    GET    /v2/models/{task}/jobs/{id}/result?format=npz|jsonl   the outputs, rows in input order (409 until done),
           streamed a chunk's outputs at a time (``edge_agent.job_results``)
    DELETE /v2/models/{task}/jobs/{id}       cancel (409 when it is finished already)

The tenant is the caller's, as for inference (the client certificate's; without TLS the tenant header); a tenant
sees only its own jobs (another's id is a 404, as an unknown one). Admission, in order: an unknown task (404), an
unknown tenant (403), no variant meeting ``min_accuracy`` (422), the body streamed to a spool file on disk (hashed
as it arrives, never whole in memory; over ``max_input_bytes``: 413), checked row by row (400 naming the line or
row), the deadline and cost ceiling against the cheapest live capacity (422 with the reason and the best feasible
deadline or cost, ``core_scheduler.policy.jobs.estimate``), the input stored in the variant store's data area (its
quota: 413 naming it), then the job's record and chunks in etcd.

Resubmission: the same input (digest) for the same task, read the same way, with the same ``min_accuracy`` (hence
the same variant) as a queued, running or done job of the tenant is answered ``200`` with that job and
``"deduplicated": true``, at the cost of the upload alone: nothing is stored again and no chunk runs again. Its
deadline and cost ceiling are that job's. ``fresh=1`` asks for a new run regardless; a failed or cancelled job is
always run afresh. Two identical submissions at once make one job: the record is written only if the index entry
is still what the lookup saw (``JobBook.create(index_seen=)``), and the door that loses answers with the winner's.

The result is streamed (``edge_agent.job_results``): JSON lines chunk by chunk, an NPZ assembled in the spool
directory on disk; memory holds one chunk's outputs (``max_result_bytes`` bounds nothing any more).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from aiohttp import web

from core_scheduler.policy.jobs import capacities, cheapest_variant, estimate, job_candidates
from core_scheduler.state.jobs import JobBook
from core_scheduler.state.view import MeshView
from edge_agent.job_follow import JobFollow, since_of, status, wait_s_of
from edge_agent.job_results import RESULT_FORMATS, stream_result
from mesh.errors import (
    ConflictError,
    ImpossibleSLO,
    PayloadTooLarge,
    RequestError,
    UnknownTask,
    UnknownTenant,
)
from mesh.etcd.keys import job_key
from mesh.jobspec import FORMATS, InputFormat, JobRecord, chunk_rows_of, dedup_fingerprint, is_job_id, plan_chunks
from mesh.log import get_logger, kv
from mesh.webhooks import allowed_target
from variant_store.data_client import DataClient
from variant_store.jobdata import scan_input

__all__ = ["MAX_INPUT_BYTES", "JobsApi"]

log = get_logger(__name__)
MAX_INPUT_BYTES = 2 << 30
MAX_RESULT_BYTES = 256 << 20
MIN_DEADLINE_S = 1.0
MAX_DEADLINE_S = 7 * 86400.0
Route = tuple[str, str, Callable[[web.Request], Any]]


class _NoJob(RequestError):
    """An unknown job, or another tenant's: 404 either way (the code stays ``bad_request``)."""

    http_status = 404


def _float(q: Any, name: str, default: float | None, lo: float, hi: float) -> float | None:
    raw = q.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError as exc:
        raise RequestError(f"{name} must be a number, got {raw[:40]!r}") from exc
    if not (math.isfinite(v) and lo <= v <= hi):
        raise RequestError(f"{name} must be in [{lo}, {hi}], got {raw[:40]}")
    return v


def _chunk_rows(raw: str | None, rows: int) -> int:
    if raw is None:
        return chunk_rows_of(rows)
    if not raw.isdigit() or not 1 <= int(raw[:12]) <= 1 << 30:
        raise RequestError(f"chunk_rows must be a whole number of rows in [1, {1 << 30}], got {raw[:40]!r}")
    return int(raw)


def _flag(q: Any, name: str) -> bool:
    raw = q.get(name, "0").lower()
    if raw not in ("0", "1", "true", "false"):
        raise RequestError(f"{name} must be 1 or 0 (true or false), got {raw[:20]!r}")
    return raw in ("1", "true")


def _format(q: Any, allowed: tuple[str, ...] = FORMATS) -> InputFormat:
    fmt = q.get("format", "npz")
    if fmt not in allowed:
        raise RequestError(f"format must be one of {', '.join(allowed)}, got {fmt[:20]!r}")
    return cast(InputFormat, fmt)


def _oip_header_length(request: web.Request) -> int | None:
    """OIP's ``Inference-Header-Content-Length`` (``tritonclient.http``'s), when sent: the file must agree."""
    raw = request.headers.get("Inference-Header-Content-Length")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 12:
        raise RequestError(f"Inference-Header-Content-Length must be a whole number of bytes, got {raw[:40]!r}")
    return int(raw)


class JobsApi:
    """The job routes of the door at ``site``. ``who(request)``: the caller's tenant (as inference's)."""

    def __init__(self, site: str, view: MeshView, book: JobBook, data: DataClient, spool: Path,
                 who: Callable[[web.Request], str], *, max_input_bytes: int = MAX_INPUT_BYTES,
                 max_result_bytes: int = MAX_RESULT_BYTES, on_admit: Callable[[], None] | None = None) -> None:
        self.site, self.view, self.book, self.data = site, view, book, data
        self.on_admit = on_admit  # a job was admitted here: this site's chunk worker looks at once
        self.spool, self.who = spool, who
        self.max_input_bytes, self.max_result_bytes = max_input_bytes, max_result_bytes
        self.follow = JobFollow(book.store)

    async def close(self) -> None:
        """End the long polls and event streams now (the door is stopping)."""
        await self.follow.close()

    def routes(self) -> list[Route]:
        base = "/v2/models/{task}/jobs"
        return [("POST", base, self.submit), ("GET", base, self.list_task), ("GET", "/v2/jobs", self.list_all),
                ("GET", base + "/{job}", self.show), ("GET", base + "/{job}/result", self.result),
                ("GET", base + "/{job}/events", self.events),
                ("DELETE", base + "/{job}", self.cancel)]

    # -- admission --------------------------------------------------------------------------------------------
    def _tenant(self, request: web.Request) -> str:
        tenant = self.who(request)
        if tenant not in self.view.tenants:
            raise UnknownTenant(f"tenant {tenant!r} is not in the topology")
        return tenant

    def _task(self, task: str, tenant: str) -> list[Any]:
        metas = job_candidates((self.view.variants.get(task) or {}).values(), tenant)
        if not metas:
            raise UnknownTask(f"unknown task {task!r}")
        return metas

    async def submit(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        task = request.match_info["task"]
        metas = self._task(task, tenant)
        q = request.query
        min_acc = _float(q, "min_accuracy", 0.0, 0.0, 1.0) or 0.0
        deadline_s = _float(q, "deadline_s", 3600.0, MIN_DEADLINE_S, MAX_DEADLINE_S) or 3600.0
        max_cost = _float(q, "max_cost", None, 0.0, 1e9)
        fmt = _format(q)
        fresh = _flag(q, "fresh")
        notify = self._notify(q.get("notify"), tenant)
        meta = cheapest_variant(metas, min_acc)
        if meta is None:
            best = max(m.accuracy for m in metas)
            raise ImpossibleSLO(f"no variant of {task!r} reaches min_accuracy {min_acc}: the best measures {best:.4f}",
                                best_accuracy=best)
        declared = request.content_length
        if declared is not None and declared > self.max_input_bytes:
            raise PayloadTooLarge(f"input of {declared} bytes is over this door's {self.max_input_bytes}",
                                  limit=self.max_input_bytes)
        now = time.time()
        path, digest, size = await self._spool(request)
        try:
            fingerprint = dedup_fingerprint(task, fmt, min_acc, meta.variant_id, digest)
            same, index_seen = (None, None) if fresh else await self.book.duplicate_of(tenant, fingerprint)
            if same is not None:
                return self._deduplicated(same, size)
            summary = await asyncio.get_running_loop().run_in_executor(
                None, scan_input, path, fmt, _oip_header_length(request) if fmt == "oip" else None)
            chunk_rows = _chunk_rows(q.get("chunk_rows"), summary.rows)
            try:
                chunks = plan_chunks(summary.rows, chunk_rows)
            except ValueError as exc:
                raise RequestError(str(exc)) from exc
            topo = self.view.topology
            est = estimate(summary.rows, len(chunks), meta,
                           capacities(topo.sites if topo is not None else {}, self.view.live))
            if est is not None and est.seconds > deadline_s:
                raise ImpossibleSLO(f"a deadline of {deadline_s:.0f} s cannot be met: {summary.rows} rows on "
                                    f"{meta.variant_id} take about {est.seconds:.0f} s on the cheapest capacity "
                                    f"({est.site}); the best feasible deadline is {math.ceil(est.seconds)} s",
                                    best_deadline_s=math.ceil(est.seconds), variant=meta.variant_id)
            if est is not None and max_cost is not None and est.cost > max_cost:
                raise ImpossibleSLO(f"max_cost {max_cost} cannot be met: the cheapest capacity ({est.site}) costs "
                                    f"about {est.cost:.6f}", best_cost=est.cost, variant=meta.variant_id)
            await self.data.put_file(tenant, digest, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        job = JobRecord(job_id=uuid.uuid4().hex, task=task, tenant=tenant, min_accuracy=min_acc,
                        deadline=now + deadline_s, input_digest=digest, rows=summary.rows, input_format=fmt,
                        chunk_rows=chunk_rows, max_cost=max_cost, variant=meta.variant_id, created=now, updated=now,
                        notify=notify)
        try:
            await self.book.create(job, index_seen=index_seen)
        except ConflictError as exc:  # an identical job was admitted at the same moment: answer with that one
            same, _ = await self.book.duplicate_of(tenant, fingerprint)
            if same is None or exc.details.get("key") == job_key(job.job_id):
                raise
            return self._deduplicated(same, size)
        if self.on_admit is not None:
            self.on_admit()
        log.info("job %s admitted: %d rows, %d chunks", job.job_id, job.rows, len(chunks),
                 extra=kv(tenant=tenant, event="job_admitted", job=job.job_id, task=task, size=size))
        body = {"id": job.job_id, "state": job.state, "rows": job.rows, "chunks": len(chunks),
                "variant": meta.variant_id, "deadline": job.deadline, "estimate_s": est.seconds if est else None,
                "estimate_cost": est.cost if est else None, "deduplicated": False, "notify": notify}
        return web.json_response(body, status=202)

    def _notify(self, raw: str | None, tenant: str) -> str | None:
        """The ``notify`` URL, canonical, if it is under one of the webhook prefixes the topology allows
        ``tenant`` (``mesh.webhooks``): 400 otherwise, before any byte of the input is read."""
        if raw is None:
            return None
        t = self.view.tenants.get(tenant)
        try:
            return allowed_target(raw, t.webhooks if t is not None else (), tenant).text
        except ValueError as exc:
            raise RequestError(str(exc)) from exc  # each reason names the notify URL

    def _deduplicated(self, same: JobRecord, size: int) -> web.Response:
        log.info("job %s resubmitted: answered with it", same.job_id,
                 extra=kv(tenant=same.tenant, event="job_deduplicated", job=same.job_id, task=same.task, size=size))
        return web.json_response({"id": same.job_id, "state": same.state, "rows": same.rows,
                                  "chunks": len(same.chunks), "variant": same.variant, "deadline": same.deadline,
                                  "deduplicated": True, "notify": same.notify})

    async def _spool(self, request: web.Request) -> tuple[Path, str, int]:
        """The body on disk (hashed as it arrives; at most ``max_input_bytes``): (path, sha256, size)."""
        self.spool.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="job-", dir=self.spool)
        h = hashlib.sha256()
        size = 0
        loop = asyncio.get_running_loop()
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in request.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > self.max_input_bytes:
                        raise PayloadTooLarge(f"input over this door's {self.max_input_bytes} bytes",
                                              limit=self.max_input_bytes)
                    h.update(chunk)
                    await loop.run_in_executor(None, f.write, chunk)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if size == 0:
            os.unlink(tmp)
            raise RequestError("the job's input (the request body) is empty")
        return Path(tmp), h.hexdigest(), size

    # -- reading ----------------------------------------------------------------------------------------------
    async def _mine(self, request: web.Request) -> Any:
        tenant = self._tenant(request)
        job_id = request.match_info["job"]
        if not is_job_id(job_id):
            raise _NoJob(f"no job {job_id[:40]!r}")
        v = await self.book.view(job_id)
        if v is None or v.job.tenant != tenant or v.job.task != request.match_info["task"]:
            raise _NoJob(f"no job {job_id} of task {request.match_info['task']!r}")
        return v

    async def _read(self, request: web.Request) -> tuple[Any, int]:
        """The caller's job and the etcd revision before the read: a watch from the next one misses nothing."""
        rev = await self.book.store.revision()
        return await self._mine(request), rev

    async def show(self, request: web.Request) -> web.Response:
        q = request.query
        if "wait" in q or "since" in q:
            wait_s, since = wait_s_of(q.get("wait", "0")), since_of(q.get("since"))
            return await self.follow.long_poll(self._tenant(request), lambda: self._read(request), wait_s, since)
        return web.json_response(status(*await self._read(request)))

    async def events(self, request: web.Request) -> web.StreamResponse:
        return await self.follow.stream(request, self._tenant(request), lambda: self._read(request))

    async def _list(self, request: web.Request, task: str | None) -> web.Response:
        tenant = self._tenant(request)
        jobs = [j for j in await self.book.list(tenant) if task is None or j.task == task]
        return web.json_response({"jobs": [{"id": j.job_id, "task": j.task, "state": j.state, "rows": j.rows,
                                            "created": j.created, "deadline": j.deadline} for j in jobs]})

    async def list_task(self, request: web.Request) -> web.Response:
        return await self._list(request, request.match_info["task"])

    async def list_all(self, request: web.Request) -> web.Response:
        return await self._list(request, None)

    async def cancel(self, request: web.Request) -> web.Response:
        v = await self._mine(request)
        if v.job.terminal:
            raise ConflictError(f"job {v.job.job_id} is {v.job.state}: there is nothing to cancel", state=v.job.state)
        try:
            rec = await self.book.set_state(v.job.job_id, "cancelled")
        except ConflictError as exc:  # it finished between our read and the CAS
            raise ConflictError(f"job {v.job.job_id} finished meanwhile: there is nothing to cancel") from exc
        return web.json_response({"id": rec.job_id, "state": rec.state})

    async def result(self, request: web.Request) -> web.StreamResponse:
        v = await self._mine(request)
        fmt = _format(request.query, RESULT_FORMATS)
        if v.job.state != "done":
            raise ConflictError(f"job {v.job.job_id} is {v.job.state} ({v.rows_done}/{v.job.rows} rows done): "
                                f"its result exists once it is done")
        return await stream_result(request, v, fmt, self.data, self.spool)
