"""A job's life after admission (issue 32), on a real etcd and a real variant store: a job its deadline passed turns
failed by compare-and-swap and no chunk of it is claimed or committed after; a finished job past retention loses its
keys and the data no kept job names; only an operator or the scheduler may delete data; and listing jobs reads
record copies, never a chunk key."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from core_scheduler.job_sweeper import sweep_once
from core_scheduler.state.jobs import JobBook
from mesh.errors import ConflictError, PermissionDenied
from mesh.etcd.keys import (
    JOBS_BY_TENANT,
    JOBS_LIVE,
    chunk_key,
    job_dedup_key,
    job_key,
    job_live_key,
    job_prefix,
    job_tenant_key,
)
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.jobs import AsyncJobs
from mesh.jobspec import ChunkRecord, JobRecord
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.helpers.mtls_edge import tenant_context
from tests.integration.test_jobs_e2e import CHEAP, TASK, _mesh, _rows
from variant_store.access import StoreTls
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.data_area import DataArea
from variant_store.data_client import DataClient
from variant_store.server import VariantStoreServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _job(rows: int = 10, chunk_rows: int = 4, *, tenant: str = "acme", digest: str = "a" * 64,
         deadline_in: float = 600.0) -> JobRecord:
    now = time.time()
    return JobRecord(job_id=uuid.uuid4().hex, task="t", tenant=tenant, min_accuracy=0.5, deadline=now + deadline_in,
                     input_digest=digest, rows=rows, input_format="npz", chunk_rows=chunk_rows, variant="v",
                     created=now, updated=now)


async def _run_chunk(book: JobBook, job_id: str, index: int, site: str, out: str, lease: Any) -> None:
    v = await book.view(job_id)
    assert v is not None
    assert await book.claim(job_id, v.chunks[index], site, lease)
    await book.commit(job_id, v.chunks[index], site, out, "v")


async def _state(book: JobBook, job_id: str) -> str | None:
    got = await book.record(job_id)
    return None if got is None else got[0].state


async def test_listing_reads_record_copies_never_a_chunk(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    book = JobBook(store)
    big, small, other = _job(rows=4000, chunk_rows=40), _job(), _job(tenant="globex")
    for job in (big, small, other):
        await book.create(job)
    await book.set_state(small.job_id, "cancelled")
    read: list[tuple[str, list[str]]] = []
    real = store.get_prefix

    async def spy(prefix: str) -> list[Any]:
        got = await real(prefix)
        read.append((prefix, [item.key for item in got]))
        return got

    monkeypatch.setattr(store, "get_prefix", spy)
    assert {r.job_id for r in await book.list()} == {big.job_id, other.job_id}  # live: not the cancelled one
    assert [r.job_id for r in await book.list("acme")] == [small.job_id, big.job_id]  # newest first
    assert [(r.job_id, r.state) for r in await book.list("globex")] == [(other.job_id, "queued")]
    assert [p for p, _ in read] == [JOBS_LIVE, f"{JOBS_BY_TENANT}acme/", f"{JOBS_BY_TENANT}globex/"]
    keys = [k for _, ks in read for k in ks]
    assert len(keys) == 2 + 2 + 1 and not any("/chunks/" in k or "/claims/" in k for k in keys)
    # a copy a site wrote at the wrong place, or junk, is skipped, not believed
    await store.put(job_tenant_key("globex", big.job_id), big.to_json())
    await store.put(job_live_key(uuid.uuid4().hex), [1, 2])
    assert [r.job_id for r in await book.list("globex")] == [other.job_id]
    assert {r.job_id for r in await book.list()} == {big.job_id, other.job_id}


async def test_a_job_written_before_the_copies_is_listed_after_reindex(store: Store) -> None:
    book = JobBook(store)
    job = _job()
    for i, (a, b) in enumerate(job.chunks):  # the first slice's layout: record and chunks, no copies
        await store.put(chunk_key(job.job_id, i), ChunkRecord(i, a, b).to_json())
    await store.put(job_key(job.job_id), job.to_json())
    assert await book.list() == [] and await book.list("acme") == []
    assert await book.reindex() == 2
    assert await book.reindex() == 0  # idempotent
    assert [r.job_id for r in await book.list()] == [job.job_id] == [r.job_id for r in await book.list("acme")]
    lease = await store.lease(30)
    await _run_chunk(book, job.job_id, 0, "edge-a", "c" * 64, lease)  # commits need the live copy: it is there now
    await lease.revoke()


async def test_a_late_job_fails_and_takes_no_claim_or_commit_after(store: Store) -> None:
    book = JobBook(store)
    lease = await store.lease(30)
    late, finished, cancelled, early = _job(deadline_in=-60), _job(deadline_in=-60), _job(deadline_in=-60), _job()
    for job in (late, finished, cancelled, early):
        await book.create(job)
    await _run_chunk(book, late.job_id, 0, "edge-a", "c" * 64, lease)
    v = await book.view(late.job_id)
    assert v is not None
    assert await book.claim(late.job_id, v.chunks[1], "edge-b", lease)  # in flight when the sweep comes
    for i in range(3):  # every chunk committed, the job not yet marked done (its site died before it could)
        await _run_chunk(book, finished.job_id, i, "edge-a", "d" * 64, lease)
    await book.set_state(cancelled.job_id, "cancelled")


    report = await sweep_once(book, None, time.time())
    assert report.failed == [late.job_id] and report.finished == [finished.job_id] and not report.errors
    rec = await book.record(late.job_id)
    assert rec is not None and rec[0].state == "failed"
    assert rec[0].error.startswith("deadline passed at ") and rec[0].error.endswith(": 4 of 10 rows done")
    assert [await _state(book, j.job_id) for j in (finished, cancelled, early)] == ["done", "cancelled", "queued"]

    # the chunk in flight is not committed; no site claims what is left; workers no longer see it
    with pytest.raises(ConflictError, match="over"):
        await book.commit(late.job_id, v.chunks[1], "edge-b", "f" * 64, "v")
    after = await book.view(late.job_id)
    assert after is not None and after.rows_done == 4
    assert not await book.claim(late.job_id, after.chunks[2], "edge-c", lease)
    assert [r.job_id for r in await book.list()] == [early.job_id]
    assert {r.job_id: r.state for r in await book.list("acme")}[late.job_id] == "failed"
    # a second sweep finds nothing more to do
    again = await sweep_once(book, None, time.time())
    assert again.failed == again.finished == []
    # a close decided on a view read before a chunk's commit loses (the sweep then reads and decides again)
    job = _job(deadline_in=-60)
    await book.create(job)
    seen = await book.view(job.job_id)
    assert seen is not None and await book.claim(job.job_id, seen.chunks[0], "edge-a", lease)
    seen = await book.view(job.job_id)
    assert seen is not None
    await book.commit(job.job_id, seen.chunks[0], "edge-a", "a" * 64, "v")
    assert await book.close(seen, "failed", "late", time.time()) is None
    await lease.revoke()


@pytest.fixture
async def data_store(store: Store, tmp_path: Path) -> AsyncIterator[tuple[VariantStoreServer, DataArea]]:
    area = DataArea(tmp_path / "data")
    async with VariantStoreServer(BlobStore(tmp_path / "blobs"), Catalog(store), host="127.0.0.1",
                                  data=area) as server:
        yield server, area


async def test_retention_removes_keys_and_the_data_no_kept_job_names(
        store: Store, data_store: tuple[VariantStoreServer, DataArea]) -> None:
    server, area = data_store
    data = DataClient(lambda: server.url, lambda: None)
    book = JobBook(store)
    lease = await store.lease(30)
    shared_in, own_in = await data.put_bytes("acme", b"shared input"), await data.put_bytes("acme", b"own input")
    out1, out2 = await data.put_bytes("acme", b"output one"), await data.put_bytes("acme", b"output two")
    globex_in = await data.put_bytes("globex", b"shared input")  # the same bytes, another tenant's object
    assert globex_in == shared_in
    old = _job(8, digest=shared_in)
    await book.create(old)
    await _run_chunk(book, old.job_id, 0, "edge-a", out1, lease)
    await _run_chunk(book, old.job_id, 1, "edge-a", out2, lease)
    assert await book.finish_if_done(old.job_id)
    live = _job(8, digest=shared_in)  # the same input again (a fresh run): its first chunk's output is out1 too
    await book.create(live)
    await _run_chunk(book, live.job_id, 0, "edge-b", out1, lease)
    gone = _job(4, digest=own_in)
    await book.create(gone)
    await book.set_state(gone.job_id, "cancelled")
    other = _job(4, tenant="globex", digest=globex_in)
    await book.create(other)
    await book.set_state(other.job_id, "failed", error="x")
    used_before = area.used("acme")

    # within retention: nothing goes
    report = await sweep_once(book, data, time.time(), retention_s=3600, data_min_age_s=0)
    assert report.removed == [] and report.data_removed == []
    # past it, but the objects were stored a moment ago: the store keeps them, and so the jobs that name them
    report = await sweep_once(book, data, time.time() + 100, retention_s=50)
    assert report.removed == [] and report.data_removed == [] and ("acme", out2) in report.data_kept
    assert area.objects("acme") == 4

    report = await sweep_once(book, data, time.time() + 100, retention_s=50, data_min_age_s=0)
    assert sorted(report.removed) == sorted([old.job_id, gone.job_id, other.job_id]) and not report.errors
    assert sorted(report.data_removed) == sorted([("acme", out2), ("acme", own_in), ("globex", globex_in)])
    assert sorted(report.data_kept) == sorted([("acme", shared_in), ("acme", out1)])  # the live job names them
    assert area.objects("acme") == 2 and area.objects("globex") == 0
    assert area.used("acme") == used_before - len(b"output two") - len(b"own input") == \
        len(b"shared input") + len(b"output one")
    assert report.bytes_freed == len(b"output two") + len(b"own input") + len(b"shared input")
    for job in (old, gone, other):
        assert await store.get_prefix(job_prefix(job.job_id)) == []
        assert await store.get(job_tenant_key(job.tenant, job.job_id)) is None
        assert await store.get(job_live_key(job.job_id)) is None
    assert await store.get(job_dedup_key("acme", gone.fingerprint)) is None
    entry = await store.get(job_dedup_key("acme", live.fingerprint))  # the same as old's: it names the live job
    assert entry is not None and entry.value["job"] == live.job_id
    v = await book.view(live.job_id)
    assert v is not None and v.rows_done == 4 and [r.job_id for r in await book.list("acme")] == [live.job_id]
    await lease.revoke()


async def test_only_an_operator_or_the_scheduler_deletes_data(store: Store, tmp_path: Path) -> None:
    pki = LocalPki.under(tmp_path)
    pki.init()
    store_id, site = Identity("store", "vs"), Identity("site", "edge-fra-1")
    acme, sched, admin = Identity("tenant", "acme"), Identity("scheduler", "s1"), Identity("admin", "ops")
    pki.issue(store_id, addresses=["127.0.0.1"])
    pki.issue(site, addresses=["127.0.0.1"])
    for who in (acme, sched, admin):
        pki.issue(who)
    area = DataArea(tmp_path / "data")

    async def body(data: bytes) -> AsyncIterator[bytes]:
        yield data

    digests = []
    for data in (b"one", b"two"):
        d = hashlib.sha256(data).hexdigest()
        await area.receive("acme", d, body(data))
        digests.append(d)
    async with VariantStoreServer(BlobStore(tmp_path / "blobs"), Catalog(store), host="127.0.0.1",
                                  tls=StoreTls(pki.paths, store_id), data=area) as server:
        def ctx(who: Identity) -> ssl.SSLContext:
            return tenant_context(pki, who)

        url = f"{server.url}/data/acme/{digests[0]}"
        for who, want in ((acme, 403), (site, 403), (sched, 200), (sched, 404)):
            async with aiohttp.ClientSession() as http, http.delete(url, ssl=ctx(who)) as r:
                assert r.status == want, (who, await r.text())
        assert area.objects("acme") == 1 and area.used("acme") == 3
        async with aiohttp.ClientSession() as http, http.delete(url + "?min_age_s=nan", ssl=ctx(admin)) as r:
            assert r.status == 400
        with pytest.raises(PermissionDenied):
            await DataClient(lambda: server.url, lambda: ctx(site)).delete("acme", digests[1])
        with pytest.raises(ConflictError):  # stored a moment ago
            await DataClient(lambda: server.url, lambda: ctx(admin)).delete("acme", digests[1], min_age_s=60)
        assert await DataClient(lambda: server.url, lambda: ctx(admin)).delete("acme", digests[1]) == 3
        assert area.objects("acme") == 0 and area.used("acme") == 0


async def test_a_late_job_on_a_running_mesh_stops(store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    """Two agents run a job's chunks; the sweep (at a clock past the job's deadline) fails it mid-way: the agents
    take none of its chunks after, a chunk in flight is not committed, and the door reports it failed."""
    x, _, _, accuracy = _rows(8)
    async with _mesh(store, etcd_server, tmp_path, accuracy) as mesh, \
            AsyncJobs(mesh.agents[CHEAP].http_url, tenant="acme") as jobs:
        job = await jobs.submit(TASK, x, min_accuracy=0.9, deadline_s=600, chunk_rows=64)
        book = JobBook(store)
        for _ in range(400):  # bounded: the first chunks land within seconds
            v = await book.view(job.id)
            if v is not None and v.chunks_done >= 2:
                break
            await asyncio.sleep(0.02)
        assert v is not None and 2 <= v.chunks_done < len(v.chunks), "the job finished before the sweep came"
        report = await sweep_once(book, None, v.job.deadline + 60)
        assert report.failed == [job.id]
        closed = await book.view(job.id)
        assert closed is not None and closed.job.state == "failed"
        ran = sum(a.chunks.chunks_done for a in mesh.agents.values() if a.chunks is not None)
        await asyncio.sleep(3.0)  # several worker polls
        after = await book.view(job.id)
        assert after is not None and after.rows_done == closed.rows_done < len(x)
        assert not any(c.claimed_by for c in after.chunks)  # an in-flight claim was given back, none taken
        assert sum(a.chunks.chunks_done for a in mesh.agents.values() if a.chunks is not None) == ran
        status = await job.status()
        assert status["state"] == "failed"
        assert status["error"].endswith(f": {closed.rows_done} of {len(x)} rows done")
