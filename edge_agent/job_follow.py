"""Following an offline job at the door without polling (issue 32 item 4), for ``edge_agent.jobs_api``:

    GET /v2/models/{task}/jobs/{id}?wait=S[&since=R]
        a long poll: the job's status (as without ``wait``) once anything of it changed after revision ``R`` (the
        ``revision`` of the caller's last status; default: the revision read now), or after ``S`` seconds
        (0 < S <= ``MAX_WAIT_S``), or at once when the job is finished
    GET /v2/models/{task}/jobs/{id}/events
        Server-Sent Events: one ``job`` event (``id:`` the etcd revision, ``data:`` the status) now and at each
        change of state, rows or chunks done, or the sites at work; ``: keep-alive`` comments between; the stream
        ends after the event that says the job is finished, or after ``max_stream_s`` (a client reconnects), or
        when the door stops

Both wait on an etcd watch of the job's keys (``core_scheduler.state.job_watch``), never on a timer. Each holds a
watch stream and a connection for its life, so a door bounds them: at most ``per_tenant`` at once for one tenant
and ``total`` in all; one more is refused ``429`` (``QuotaExceeded``, ``Retry-After``) rather than queued.
A burst of chunk commits is read once: after a wake-up the follower waits ``settle_s`` before reading the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

from core_scheduler.state.job_watch import JobWatch
from core_scheduler.state.jobs import JobView
from mesh.errors import MeshError, QuotaExceeded, RequestError
from mesh.etcd.store import Store
from mesh.log import get_logger, kv

__all__ = ["MAX_WAIT_S", "JobFollow", "Reader"]

log = get_logger(__name__)
MAX_WAIT_S = 60.0      # a long poll past this would outlive the idle timeouts of proxies between caller and door
MAX_STREAM_S = 600.0
KEEPALIVE_S = 15.0
Reader = Callable[[], Awaitable[tuple[JobView, int]]]  # the job as the caller may see it, and the revision read at


def status(v: JobView, revision: int) -> dict[str, Any]:
    return {**v.to_json(), "revision": revision}


def wait_s_of(raw: str) -> float:
    try:
        v = float(raw)
    except ValueError as exc:
        raise RequestError(f"wait must be a number of seconds, got {raw[:40]!r}") from exc
    if not (math.isfinite(v) and 0.0 <= v <= MAX_WAIT_S):
        raise RequestError(f"wait must be in [0, {MAX_WAIT_S:.0f}] seconds, got {raw[:40]}")
    return v


def since_of(raw: str | None) -> int | None:
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19:
        raise RequestError(f"since must be a revision (a whole number >= 0), got {raw[:40]!r}")
    return int(raw)


class JobFollow:
    """The long polls and event streams of one door, over ``store``; ``close()`` ends them all at once."""

    def __init__(self, store: Store, *, per_tenant: int = 8, total: int = 256, max_stream_s: float = MAX_STREAM_S,
                 keepalive_s: float = KEEPALIVE_S, settle_s: float = 0.05) -> None:
        self.store = store
        self.per_tenant, self.total = per_tenant, total
        self.max_stream_s, self.keepalive_s, self.settle_s = max_stream_s, keepalive_s, settle_s
        self.open: dict[str, int] = {}   # tenant -> followers now
        self._closing = asyncio.Event()

    @property
    def followers(self) -> int:
        return sum(self.open.values())

    async def close(self) -> None:
        self._closing.set()

    @contextlib.contextmanager
    def _slot(self, tenant: str) -> Iterator[None]:
        if self._closing.is_set():
            raise QuotaExceeded("this door is stopping: ask another", retry_after_s=1)
        if self.open.get(tenant, 0) >= self.per_tenant or self.followers >= self.total:
            raise QuotaExceeded(f"tenant {tenant!r} follows {self.open.get(tenant, 0)} jobs at this door already "
                                f"(at most {self.per_tenant} per tenant, {self.total} in all): close one, or poll",
                                retry_after_s=1)
        self.open[tenant] = self.open.get(tenant, 0) + 1
        try:
            yield
        finally:
            self.open[tenant] -= 1
            if not self.open[tenant]:
                del self.open[tenant]

    async def _wake(self, watch: JobWatch, timeout: float) -> bool | None:  # noqa: ASYNC109
        """True on a change, False after ``timeout``, None when the door is stopping."""
        if self._closing.is_set():
            return None
        changed = asyncio.ensure_future(watch.wait(timeout))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({changed, closing}, return_when=asyncio.FIRST_COMPLETED)
            stopping = closing.done()
        finally:
            for f in (changed, closing):
                f.cancel()
            await asyncio.gather(changed, closing, return_exceptions=True)
        return None if stopping or changed.cancelled() else changed.result()

    async def long_poll(self, tenant: str, read: Reader, wait_s: float, since: int | None) -> web.Response:
        with self._slot(tenant):
            v, rev = await read()
            if v.job.terminal or wait_s <= 0:
                return web.json_response(status(v, rev))
            async with JobWatch(self.store, v.job.job_id, rev if since is None else min(since, rev)) as watch:
                changed = await self._wake(watch, wait_s)
            if changed:
                await asyncio.sleep(self.settle_s)
                v, rev = await read()
            return web.json_response(status(v, rev))

    async def stream(self, request: web.Request, tenant: str, read: Reader) -> web.StreamResponse:
        with self._slot(tenant):
            v, rev = await read()  # before the stream starts: an unknown job is still a JSON 404
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                               "X-Accel-Buffering": "no"})
            await resp.prepare(request)
            loop = asyncio.get_running_loop()
            end = loop.time() + self.max_stream_s
            sent: tuple[Any, ...] | None = None
            try:
                async with JobWatch(self.store, v.job.job_id, rev) as watch:
                    while True:
                        body = status(v, rev)
                        now = (body["state"], body["rows_done"], body["chunks_done"], tuple(body["sites"]))
                        if now != sent:
                            sent = now
                            await resp.write(f"id: {rev}\nevent: job\ndata: {json.dumps(body)}\n\n".encode())
                        left = end - loop.time()
                        if v.job.terminal or left <= 0:
                            break
                        changed = await self._wake(watch, min(self.keepalive_s, left))
                        if changed is None:
                            break
                        if not changed:
                            await resp.write(b": keep-alive\n\n")
                            continue
                        await asyncio.sleep(self.settle_s)
                        try:
                            v, rev = await read()
                        except MeshError as exc:  # the job went (or etcd did): say so in the stream, and end it
                            data = json.dumps({"error": str(exc), "code": exc.code})
                            await resp.write(f"event: error\ndata: {data}\n\n".encode())
                            break
            except (ConnectionError, RuntimeError):
                log.debug("job event stream closed by its caller", extra=kv(tenant=tenant, event="job_stream_gone"))
                return resp
            with contextlib.suppress(ConnectionError, RuntimeError):
                await resp.write_eof()
            return resp
