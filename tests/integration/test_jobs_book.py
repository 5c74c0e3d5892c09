"""Offline jobs' compare-and-swap rules on a real etcd (``core_scheduler.state.jobs``): a chunk is claimed by one
site at a time, committed once, only by its claim's holder; a claim dies with its site's lease and the chunk is
claimable again; a finished job cannot be cancelled; a job turns done when its last chunk does."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from core_scheduler.state.jobs import JobBook
from mesh.errors import ConflictError, ProtocolError
from mesh.etcd.keys import chunk_key
from mesh.etcd.store import Store
from mesh.jobspec import JobRecord

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _job(rows: int = 10, chunk_rows: int = 4) -> JobRecord:
    now = time.time()
    return JobRecord(job_id=uuid.uuid4().hex, task="t", tenant="acme", min_accuracy=0.5, deadline=now + 600,
                     input_digest="a" * 64, rows=rows, input_format="npz", chunk_rows=chunk_rows, created=now,
                     updated=now)


async def test_claims_and_commits_happen_once(store: Store) -> None:
    book = JobBook(store)
    job = _job()
    await book.create(job)
    with pytest.raises(ConflictError):
        await book.create(job)
    v = await book.view(job.job_id)
    assert v is not None and [c.chunk.rows for c in v.chunks] == [4, 4, 2] and v.rows_done == 0
    first = v.chunks[0]
    lease_a, lease_b = await store.lease(2), await store.lease(30)
    assert await book.claim(job.job_id, first, "edge-a", lease_a)
    assert not await book.claim(job.job_id, first, "edge-b", lease_b)  # held
    with pytest.raises(ConflictError):  # not b's claim
        await book.commit(job.job_id, first, "edge-b", "b" * 64, "v")
    done = await book.commit(job.job_id, first, "edge-a", "c" * 64, "v")
    assert done.state == "done" and done.site == "edge-a"
    with pytest.raises(ConflictError):  # a second commit of the same chunk
        await book.commit(job.job_id, first, "edge-a", "d" * 64, "v")
    v = await book.view(job.job_id)
    assert v is not None and v.chunks[0].chunk.output_digest == "c" * 64 and v.chunks[0].claimed_by is None
    assert not await book.claim(job.job_id, v.chunks[0], "edge-b", lease_b)  # done: nothing to claim

    # a claim under a lease that dies (its site gone) frees the chunk for another site
    second = v.chunks[1]
    assert await book.claim(job.job_id, second, "edge-a", lease_a)
    await lease_a.stop()  # keep-alives stop; etcd expires the lease within its TTL
    for _ in range(100):  # bounded: TTL 2 s
        v = await book.view(job.job_id)
        assert v is not None
        if v.chunks[1].claimed_by is None:
            break
        await asyncio.sleep(0.1)
    assert v.chunks[1].claimed_by is None, "the dead site's claim outlived its lease"
    assert await book.claim(job.job_id, v.chunks[1], "edge-b", lease_b)
    with pytest.raises(ConflictError):  # the dead site's late commit loses
        await book.commit(job.job_id, v.chunks[1], "edge-a", "e" * 64, "v")
    await book.commit(job.job_id, v.chunks[1], "edge-b", "f" * 64, "v")
    assert not await book.finish_if_done(job.job_id)
    v = await book.view(job.job_id)
    assert v is not None
    assert await book.claim(job.job_id, v.chunks[2], "edge-b", lease_b)
    await book.commit(job.job_id, v.chunks[2], "edge-b", "0" * 64, "v")
    assert await book.finish_if_done(job.job_id)
    v = await book.view(job.job_id)
    assert v is not None and v.job.state == "done" and v.rows_done == 10 and v.sites == ["edge-a", "edge-b"]
    with pytest.raises(ConflictError, match="done: it cannot become cancelled"):
        await book.set_state(job.job_id, "cancelled")
    await lease_b.revoke()


async def test_cancel_and_a_tampered_chunk(store: Store) -> None:
    book = JobBook(store)
    job = _job()
    await book.create(job)
    assert (await book.set_state(job.job_id, "cancelled")).state == "cancelled"
    assert [j.job_id for j in await book.list("acme")] == [job.job_id] and await book.list("globex") == []
    assert not await book.finish_if_done(job.job_id)
    # a site wrote junk where a chunk was: the view says so rather than guess
    await store.put(chunk_key(job.job_id, 1), {"schema": 1, "index": 1, "start": 0, "stop": 99, "state": "queued"})
    with pytest.raises(ProtocolError, match="plan"):
        await book.view(job.job_id)
    await store.put(chunk_key(job.job_id, 1), [1, 2, 3])
    with pytest.raises(ProtocolError):
        await book.view(job.job_id)
