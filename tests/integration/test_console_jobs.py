"""The console's jobs view on a real etcd (issue 32 item 5): ``/api/jobs`` sums each tenant's jobs by state, with
their progress, the sites holding chunk claims now and the sites that ran chunks, from the records the doors and
chunk workers write (``JobBook``, here driven by the test); a job record a site tampered with is left out, not
fatal; every tenant of the topology is listed; the admin gate holds."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from console import ConsoleConfig, ConsoleServer
from core_scheduler.state.jobs import JobBook
from mesh.etcd.keys import job_key
from mesh.etcd.store import Store
from mesh.jobspec import JobRecord
from tests.integration.test_console_server import TOKEN, TOPOLOGY
from topology.loader import parse_topology
from topology.store_io import apply

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _job(tenant: str, rows: int = 12, created: float = 0.0, deadline_in: float = 600.0) -> JobRecord:
    now = time.time()
    return JobRecord(job_id=uuid.uuid4().hex, task="digit-classification", tenant=tenant, min_accuracy=0.5,
                     deadline=now + deadline_in, input_digest="a" * 64, rows=rows, input_format="npz", chunk_rows=4,
                     variant="mlp-tiny.onnx.fp32", created=now + created, updated=now)


@pytest.fixture
async def console(store: Store) -> AsyncIterator[ConsoleServer]:
    await apply(store, parse_topology(TOPOLOGY), source=TOPOLOGY)
    server = ConsoleServer(store, ConsoleConfig(token=TOKEN, tick_s=0.2))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _get(url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as resp:
        return resp.status, await resp.json()


async def test_the_jobs_view_sums_each_tenants_jobs(store: Store, console: ConsoleServer) -> None:
    status, empty = await _get(console.url + "/api/jobs", headers=AUTH)
    assert status == 200 and [t["tenant"] for t in empty["tenants"]] == ["acme", "globex"]
    assert all(t["jobs"] == [] and sum(t["counts"].values()) == 0 for t in empty["tenants"])

    book = JobBook(store)
    lease = await store.lease(30)
    queued, running, done = _job("acme", created=-3), _job("acme", created=-2, deadline_in=-1), _job("acme", 4)
    cancelled, failed = _job("globex", created=-5), _job("globex", created=-4)
    for job in (queued, running, done, cancelled, failed):
        await book.create(job)
    # running: chunk 0 ran at edge-a, chunk 1 ran at mid, chunk 2 is being run at mid now
    v = await book.view(running.job_id)
    assert v is not None
    for i, site in ((0, "edge-a"), (1, "mid"), (2, "mid")):
        assert await book.claim(running.job_id, v.chunks[i], site, lease)
        if i < 2:
            await book.commit(running.job_id, v.chunks[i], site, "c" * 64, "mlp-tiny.onnx.fp32")
    await book.set_state(running.job_id, "running")
    v = await book.view(done.job_id)
    assert v is not None and await book.claim(done.job_id, v.chunks[0], "core", lease)
    await book.commit(done.job_id, v.chunks[0], "core", "d" * 64, "mlp-tiny.onnx.fp32")
    assert await book.finish_if_done(done.job_id)
    await book.set_state(cancelled.job_id, "cancelled")
    await book.set_state(failed.job_id, "failed", error="chunk 0: the input is gone")
    tampered = _job("acme")
    await book.create(tampered)
    await store.put(job_key(tampered.job_id), {"schema": 1, "job_id": tampered.job_id, "rows": -1})

    status, body = await _get(console.url + "/api/jobs", headers=AUTH)
    assert status == 200
    acme, globex = body["tenants"]
    assert acme["tenant"] == "acme" and globex["tenant"] == "globex"
    assert acme["counts"] == {"queued": 1, "running": 1, "done": 1, "failed": 0, "cancelled": 0}
    assert globex["counts"] == {"queued": 0, "running": 0, "done": 0, "failed": 1, "cancelled": 1}
    assert acme["rows"] == 12 + 12 + 4 and acme["rows_done"] == 8 + 4
    by_id = {j["id"]: j for j in acme["jobs"]}
    assert [j["id"] for j in acme["jobs"]] == [done.job_id, running.job_id, queued.job_id]  # newest first
    r = by_id[running.job_id]
    assert (r["state"], r["chunks"], r["chunks_done"], r["rows_done"]) == ("running", 3, 2, 8)
    assert r["working"] == {"mid": 1} and r["ran"] == {"edge-a": 1, "mid": 1} and r["late"] is True
    assert r["progress"] == pytest.approx(8 / 12)
    d = by_id[done.job_id]
    assert d["working"] == {} and d["ran"] == {"core": 1} and d["progress"] == 1.0 and d["late"] is False
    assert by_id[queued.job_id]["working"] == {} and by_id[queued.job_id]["ran"] == {}
    assert {j["id"]: j["error"] for j in globex["jobs"]}[failed.job_id] == "chunk 0: the input is gone"

    # one tenant; an unknown one; and no token, no view
    status, only = await _get(console.url + "/api/jobs", params={"tenant": "globex"}, headers=AUTH)
    assert status == 200 and [t["tenant"] for t in only["tenants"]] == ["globex"]
    assert {j["id"] for j in only["tenants"][0]["jobs"]} == {cancelled.job_id, failed.job_id}
    status, missing = await _get(console.url + "/api/jobs", params={"tenant": "initech"}, headers=AUTH)
    assert status == 404 and "initech" in missing["error"]
    async with aiohttp.ClientSession() as s, s.get(console.url + "/api/jobs") as resp:
        assert resp.status == 401
    await lease.revoke()
