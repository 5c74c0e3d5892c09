"""Following a job without polling, on a real etcd: the door's job API (``edge_agent.jobs_api``, served here by a
small aiohttp app with the door's error mapping) answers a long poll when the job's keys change (a claim, a
commit, a cancel), at once for a change it already missed (``since``) or a finished job, and after ``wait``
seconds otherwise; its event stream sends each change and ends with the job; followers per tenant are bounded
(429), and closing the door ends them. The job's records are written here as the chunk workers write them
(``JobBook``), so each change happens when the test says."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from core_scheduler.state.job_watch import JobWatch
from core_scheduler.state.jobs import JobBook
from core_scheduler.state.view import MeshView
from edge_agent.jobs_api import JobsApi
from mesh.errors import MeshError, QuotaExceeded
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.jobspec import JobRecord
from mesh.v2.body import TENANT_HEADER
from tests.helpers.http_stub import serve_app
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.data_client import DataClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SMALL = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
TASK = "digit-classification"
ACME = {TENANT_HEADER: "acme"}


def _job(tenant: str = "acme") -> JobRecord:
    now = time.time()
    return JobRecord(job_id=uuid.uuid4().hex, task=TASK, tenant=tenant, min_accuracy=0.5, deadline=now + 600,
                     input_digest="a" * 64, rows=10, input_format="npz", chunk_rows=4, created=now, updated=now)


class Door:
    def __init__(self, api: JobsApi, url: str, http: aiohttp.ClientSession) -> None:
        self.api, self.url, self.http = api, url, http

    def job_url(self, job: JobRecord) -> str:
        return f"{self.url}/v2/models/{TASK}/jobs/{job.job_id}"

    async def get(self, job: JobRecord, headers: Mapping[str, str] = ACME, params: Mapping[str, str] | None = None,
                  **more: str) -> tuple[int, Any, float]:
        t0 = time.monotonic()
        async with self.http.get(self.job_url(job), params={**(params or {}), **more}, headers=headers) as r:
            return r.status, await r.json(), time.monotonic() - t0


@pytest.fixture
async def door(store: Store, tmp_path: Path) -> AsyncIterator[Door]:
    await apply_topology(store, load_topology_file(SMALL))
    view = MeshView(store, "edge-fra-1")
    await view.start()
    api = JobsApi("edge-fra-1", view, JobBook(store), cast(DataClient, None), tmp_path / "spool",
                  lambda request: request.headers[TENANT_HEADER])
    app = web.Application()
    for method, path, handler in api.routes():
        async def guarded(request: web.Request, handler: Any = handler) -> web.StreamResponse:
            try:
                return cast(web.StreamResponse, await handler(request))
            except MeshError as exc:  # as the door maps them (edge_agent.http_api)
                headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QuotaExceeded) else None
                return web.json_response(exc.to_dict(), status=exc.http_status, headers=headers)
        app.router.add_route(method, path, guarded)
    try:
        async with serve_app(app) as url, aiohttp.ClientSession() as http:
            yield Door(api, url, http)
    finally:
        await api.close()
        await view.stop()


async def test_a_long_poll_answers_when_the_job_changes(store: Store, door: Door) -> None:
    book = JobBook(store)
    job = _job()
    await book.create(job)
    status, first, _ = await door.get(job)
    assert status == 200 and first["state"] == "queued" and isinstance(first["revision"], int)

    # held until a site claims a chunk, then answered with the change
    poll = asyncio.create_task(door.get(job, wait="10", since=str(first["revision"])))
    await asyncio.sleep(0.3)
    assert not poll.done()
    lease = await store.lease(30)
    v = await book.view(job.job_id)
    assert v is not None and await book.claim(job.job_id, v.chunks[0], "edge-a", lease)
    status, claimed, took = await poll
    assert status == 200 and claimed["sites"] == ["edge-a"] and claimed["revision"] > first["revision"]
    assert 0.3 <= took < 3.0

    # a change made before the next poll arrives is not missed: `since` replays it at once
    await book.commit(job.job_id, v.chunks[0], "edge-a", "c" * 64, "v")
    status, committed, took = await door.get(job, wait="10", since=str(claimed["revision"]))
    assert status == 200 and committed["chunks_done"] == 1 and committed["rows_done"] == 4 and took < 1.0

    # nothing changes: answered after `wait` seconds with the same status
    status, same, took = await door.get(job, wait="0.4", since=str(committed["revision"]))
    assert status == 200 and same["rows_done"] == 4 and 0.4 <= took < 2.0

    # a finished job is answered at once
    await book.set_state(job.job_id, "cancelled")
    status, ended, took = await door.get(job, wait="30", since=str(committed["revision"]))
    assert status == 200 and ended["state"] == "cancelled" and took < 1.0

    # bad parameters say which and why; another tenant's job does not exist for it
    for params, word in (({"wait": "61"}, "wait"), ({"wait": "soon"}, "wait"), ({"wait": "nan"}, "wait"),
                         ({"wait": "1", "since": "-3"}, "since"), ({"wait": "1", "since": "9" * 30}, "since")):
        status, body, _ = await door.get(job, params=params)
        assert status == 400 and word in body["error"], params
    status, body, _ = await door.get(job, headers={TENANT_HEADER: "globex"}, wait="5")
    assert status == 404
    await lease.revoke()


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, Any]]:
    """(event, data) of each server-sent event, ("keep-alive", None) for a comment, until the stream ends."""
    name, data = "message", ""
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith(":"):
            yield "keep-alive", None
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data:
            yield name, json.loads(data)
            name, data = "message", ""


async def test_the_event_stream_follows_a_job_to_its_end(store: Store, door: Door) -> None:
    book = JobBook(store)
    job = _job()
    await book.create(job)
    lease = await store.lease(30)
    seen: list[dict[str, Any]] = []
    async with door.http.get(door.job_url(job) + "/events", headers=ACME) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = _events(resp)
        name, first = await anext(events)
        assert name == "job" and first["state"] == "queued" and first["chunks_done"] == 0
        for i in range(3):  # each chunk claimed, then committed, as a worker does
            v = await book.view(job.job_id)
            assert v is not None and await book.claim(job.job_id, v.chunks[i], "edge-a", lease)
            if i == 0:
                await book.set_state(job.job_id, "running", only_from=("queued",))
            await book.commit(job.job_id, v.chunks[i], "edge-a", "c" * 64, "v")
            await asyncio.sleep(0.15)  # past the follower's settle time: one event per step
        await book.finish_if_done(job.job_id)
        async with asyncio.timeout(5):
            async for name, data in events:
                if name == "job":
                    seen.append(data)
        # the stream ended by itself after the event that says done
    assert seen[-1]["state"] == "done" and seen[-1]["rows_done"] == 10 and seen[-1]["chunks_done"] == 3
    assert [s["chunks_done"] for s in seen] == sorted(s["chunks_done"] for s in seen)  # never backwards
    assert any(s["state"] == "running" and 0 < s["chunks_done"] < 3 for s in seen)
    revisions = [s["revision"] for s in seen]
    assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
    await lease.revoke()


async def test_followers_are_bounded_and_end_with_the_door(store: Store, door: Door) -> None:
    book = JobBook(store)
    job, theirs = _job(), _job("globex")
    await book.create(job)
    await book.create(theirs)
    door.api.follow.per_tenant = 1
    door.api.follow.keepalive_s = 0.2
    async with door.http.get(door.job_url(job) + "/events", headers=ACME) as held:
        events = _events(held)
        assert (await anext(events))[0] == "job"
        assert (await anext(events))[0] == "keep-alive"  # nothing changes: the stream says it is alive
        # a second follower of acme's is refused while the first holds its place; globex's is not
        async with door.http.get(door.job_url(job) + "/events", headers=ACME) as second:
            body = await second.json()
            assert second.status == 429 and second.headers["Retry-After"] == "1" and "at most 1" in body["error"]
        status, body, _ = await door.get(job, wait="5")
        assert status == 429 and body["code"] == "quota_exceeded"
        status, _, took = await door.get(theirs, headers={TENANT_HEADER: "globex"}, wait="0.2")
        assert status == 200 and took < 2.0
        # the door stops: the open stream ends at once rather than at its keep-alive or lifetime
        t0 = time.monotonic()
        await door.api.close()
        async with asyncio.timeout(3):
            rest = [name async for name, _ in events]
        assert "job" not in rest and time.monotonic() - t0 < 2.0
    assert door.api.follow.followers == 0
    status, body, _ = await door.get(job, wait="1")
    assert status == 429 and "stopping" in body["error"]


async def test_a_stream_has_a_bounded_life(store: Store, door: Door) -> None:
    job = _job()
    await JobBook(store).create(job)
    door.api.follow.max_stream_s = 0.5
    t0 = time.monotonic()
    async with door.http.get(door.job_url(job) + "/events", headers=ACME) as resp:
        names = [name async for name, _ in _events(resp)]
    assert names[0] == "job" and 0.5 <= time.monotonic() - t0 < 3.0  # ends; the client reconnects for more
    assert door.api.follow.followers == 0


async def test_a_watch_past_compaction_wakes_its_reader_and_goes_on(fresh_etcd: EmbeddedEtcd) -> None:
    async with await Store.connect(fresh_etcd.url, prefix="/c/") as store:
        book = JobBook(store)
        job = _job()
        await book.create(job)
        seen = await store.revision()
        await book.set_state(job.job_id, "running")
        await store.compact(await store.put("other", 1))  # the job's change after `seen` is history now
        async with JobWatch(store, job.job_id, seen) as watch:
            t0 = time.monotonic()
            assert await watch.wait(5.0) and time.monotonic() - t0 < 3.0  # woken: it re-reads, missing nothing
            assert not await watch.wait(0.2)
            await book.set_state(job.job_id, "cancelled")
            assert await watch.wait(5.0)  # and it follows on from the present
