"""The scheduler leader runs the offline-job round after placement (``core_scheduler.job_rounds``): on a real etcd
and a real variant store that announced itself, a leading ``Scheduler`` fails a job its deadline passed and, once a
finished job is past retention, removes its keys and its data; a replica that does not lead does neither."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from core_scheduler.scheduler import Scheduler, SchedulerConfig
from core_scheduler.state.jobs import JobBook
from mesh.etcd.keys import job_prefix
from mesh.etcd.store import Store
from tests.integration.test_jobs_sweep import _job, _run_chunk, _state
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.data_area import DataArea
from variant_store.data_client import DataClient
from variant_store.server import VariantStoreServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
async def announced_store(store: Store, tmp_path: Path) -> AsyncIterator[tuple[VariantStoreServer, DataArea]]:
    area = DataArea(tmp_path / "data")
    async with VariantStoreServer(BlobStore(tmp_path / "blobs"), Catalog(store), host="127.0.0.1",
                                  data=area) as server:  # announces itself at services/variant-store
        yield server, area


async def _until(what: str, check: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


async def test_the_leader_fails_late_jobs_and_removes_retained_ones(
        store: Store, announced_store: tuple[VariantStoreServer, DataArea]) -> None:
    server, area = announced_store
    data = DataClient(lambda: server.url, lambda: None)
    book = JobBook(store)
    lease = await store.lease(30)
    try:
        late = _job(deadline_in=-60)
        await book.create(late)
        own_in, out = await data.put_bytes("acme", b"an input"), await data.put_bytes("acme", b"an output")
        old = _job(4, digest=own_in)
        await book.create(old)
        await _run_chunk(book, old.job_id, 0, "edge-a", out, lease)
        assert await book.finish_if_done(old.job_id)
        assert area.objects("acme") == 2

        sched = Scheduler(store, SchedulerConfig(candidate_id="jobs-leader", interval_s=0.2, job_retention_s=1.0))
        sched.jobs.retention_every_s = 0.2
        sched.jobs.data_min_age_s = 0.0
        async with sched:
            errors: list[str] = []

            async def failed() -> bool:
                rec = await book.record(late.job_id)
                if rec is not None and rec[0].state == "failed":
                    errors.append(rec[0].error)
                return bool(errors)

            async def removed() -> bool:
                return not await store.get_prefix(job_prefix(old.job_id)) and area.objects("acme") == 0

            await _until("the late job failed by the leader", failed)
            await _until("the retained job's keys and data removed", removed)
            assert sched.is_leader and sched.jobs.failed_late >= 1 and sched.jobs.removed >= 1
            assert "deadline passed" in errors[0]
            # a failed job is a finished one: past retention it goes too
            await _until("the failed job removed", lambda: _gone(store, late.job_id))
    finally:
        await lease.revoke()


async def test_a_replica_that_does_not_lead_sweeps_nothing(store: Store) -> None:
    book = JobBook(store)
    late = _job(deadline_in=-60)
    await book.create(late)
    leader = Scheduler(store, SchedulerConfig(candidate_id="a-leader", interval_s=0.2))
    async with leader:
        await _until("a leader", lambda: asyncio.sleep(0, leader.is_leader))
        await _until("the late job failed", lambda: _is_failed(book, late.job_id))
        follower = Scheduler(store, SchedulerConfig(candidate_id="a-follower", interval_s=0.2))
        async with follower:
            another = _job(deadline_in=-60)
            await book.create(another)
            await _until("failed by the leader", lambda: _is_failed(book, another.job_id))
            assert not follower.is_leader and follower.jobs.failed_late == 0
            assert leader.jobs.failed_late == 2


async def _is_failed(book: JobBook, job_id: str) -> bool:
    return await _state(book, job_id) == "failed"


async def _gone(store: Store, job_id: str) -> bool:
    return not await store.get_prefix(job_prefix(job_id))
