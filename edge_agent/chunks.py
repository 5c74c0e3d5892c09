"""A site's offline-job chunk worker: harvests the capacity online queries leave idle.

Not built yet (issue 32): webhook notifications (long poll and SSE: ``edge_agent.job_follow``; dedup and the
console's view are built), narrowing which site may write which job's keys (and which site may read which
tenant's data), acting on a deadline that passes (a late job is neither failed nor hurried), retention
of finished jobs' records and data, and reading job records without their chunks (each poll reads ``jobs/``
whole: fine for a few jobs of a few hundred chunks, not for thousands).

How it works now. Every ``poll_s`` the worker reads the jobs in etcd (``core_scheduler.state.jobs``) and claims
one queued chunk at a time under its own etcd lease (``core_scheduler.policy.jobs.claim_choice``): first a chunk
the scheduler leader assigned to this site (``core_scheduler.job_planner``: cheapest sites first, dearer ones only
as a job's deadline needs them); in a job the leader leads, nothing else; in a job no live leader leads (none
yet, or its assignments not renewed for ``ASSIGN_GRACE_S``) the local rule: this site is idle and among the
cheapest idle sites (price per core from the topology; after ``CLAIM_GRACE_S`` any idle site may). It runs it,
stores the outputs in the data area and commits the chunk done by compare-and-swap. The claim lives under the
lease: a site that dies or is cut off loses it a TTL later and the chunk is claimable again; a commit by anyone
but the claim's holder, or a second commit, fails.

Online always wins: a chunk runs ``batch_rows`` at a time (text: fewer) on the variant's runtime directly, a head
after its shared backbone's session (not through the online batcher: ``edge_agent.chunk_run``), and before each
batch the worker waits while online queries are in flight at this site (``online_busy()``), so a chunk adds at
most one batch's compute (~1-3 ms for the digits family at 256 rows) to an arriving query's wait. The job's
variant is the cheapest meeting its ``min_accuracy`` chosen at admission (or, should the catalog have lost it, the
cheapest now).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from core_scheduler.policy.jobs import capacities, cheapest_variant, claim_choice, job_candidates
from core_scheduler.state.job_assign import JobAssignments
from core_scheduler.state.jobs import JobBook, JobView, SeenChunk
from core_scheduler.state.supervise import supervise
from core_scheduler.state.view import MeshView
from edge_agent.chunk_run import ChunkRun, feed, run_rows
from edge_agent.host import VariantHost
from mesh.errors import ConflictError, MeshError, PermissionDenied, RequestError, Unauthenticated
from mesh.etcd.lease import Lease
from mesh.etcd.store import Store
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from variant_store.data_client import DataClient
from variant_store.jobdata import encode_outputs, read_rows
from variant_store.meta import VariantMeta

__all__ = ["ChunkWorker"]

log = get_logger(__name__)
MAX_INPUT_BYTES = 4 << 30
MAX_CHUNK_OUTPUT_BYTES = 256 << 20
BATCH_ROWS = 256  # rows per runtime call
IDLE_POLL_S = 2.0  # how often a site that saw no live job at its last look reads etcd for one (sooner if woken)
# a job whose variant the store refused this site (403/401: no assignment or placement grants it) is skipped this
# long: without it the site claimed the chunk, was refused and released it at every poll
REFUSED_BACKOFF_S = 30.0


class ChunkWorker(Service):
    """Runs chunks of offline jobs at ``site``. ``online_busy()``: whether online work is in flight here now."""

    def __init__(self, site: str, store: Store, view: MeshView, host: VariantHost, data: DataClient, work_dir: Path,
                 online_busy: Callable[[], bool], *, poll_s: float = 1.0, lease_ttl_s: float = 5.0,
                 batch_rows: int = BATCH_ROWS, pause_s: float = 0.005) -> None:
        self.site, self.store, self.view, self.host, self.data = site, store, view, host, data
        self.book = JobBook(store)
        self.work_dir = work_dir
        self.online_busy = online_busy
        self.poll_s, self.lease_ttl_s, self.batch_rows, self.pause_s = poll_s, lease_ttl_s, batch_rows, pause_s
        self._live_jobs = True  # until the first look says otherwise
        self._woken = asyncio.Event()
        self._lease: Lease | None = None
        self._task: asyncio.Task[None] | None = None
        self._refused: dict[str, float] = {}  # job -> time.monotonic() until which this site leaves it alone
        self.chunks_done = 0
        self.rows_done = 0
        self.paused_s = 0.0  # time spent waiting for online work to pass
        self.compute_s = 0.0  # time in the runtime's infer (what a job's cost is priced on: bench.offline)

    async def _start(self) -> None:
        self._task = asyncio.create_task(supervise("chunk worker", self._loop, site=self.site),
                                         name=f"chunks:{self.site}")

    async def _stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        lease, self._lease = self._lease, None
        if lease is not None:  # our claims go with it now, not a TTL later
            with contextlib.suppress(MeshError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await lease.revoke()

    async def _my_lease(self) -> Lease:
        if self._lease is None or not self._lease.alive:
            self._lease = await self.store.lease(self.lease_ttl_s)
        return self._lease

    async def _loop(self) -> None:
        while True:
            worked = await self.run_once()
            if not worked:
                # no live job at the last look: an idle mesh's sites (a tenth of a core at an edge) read etcd
                # every IDLE_POLL_S, not every second
                await self._pause(self.poll_s if self._live_jobs else max(self.poll_s, IDLE_POLL_S))

    def wake(self) -> None:
        """Look for work now (a job was just admitted at this site's door)."""
        self._woken.set()

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._woken.wait()
        self._woken.clear()

    async def run_once(self) -> bool:
        """Claim and run at most one chunk; True if one was run (or lost to a race: look again at once)."""
        if self.online_busy():
            return False
        jobs = await self.book.list()
        self._live_jobs = any(not job.terminal for job in jobs)
        fallback: tuple[JobView, SeenChunk] | None = None  # a chunk claimable by the local rule, if none is assigned
        mono = time.monotonic()
        self._refused = {j: until for j, until in self._refused.items() if until > mono}  # bounded: live ones only
        for job in sorted(jobs, key=lambda j: j.created):
            if job.terminal or job.job_id in self._refused:
                continue
            try:
                v = await self.book.view(job.job_id)
            except MeshError as exc:
                log.warning("job %s unreadable: %s", job.job_id, exc, extra=kv(site=self.site, event="job_unreadable"))
                continue
            if v is None:
                continue
            queued = {c.chunk.index: c for c in v.chunks if c.chunk.state == "queued" and c.claimed_by is None}
            if not queued:
                await self.book.finish_if_done(job.job_id)
                continue
            assigned = await JobAssignments(self.store).read(job.job_id)
            topo = self.view.topology
            caps = capacities(topo.sites if topo is not None else {}, self.view.live)
            now = time.time()
            pick = claim_choice(self.site, sorted(queued), assigned, caps, now, now - job.created)
            if pick is None:
                continue
            if (a := assigned.get(pick)) is not None and a.site == self.site:
                return await self._take(v, queued[pick])  # the leader's choice goes before any other
            fallback = fallback or (v, queued[pick])
        return await self._take(*fallback) if fallback is not None else False

    def _variant(self, v: JobView) -> VariantMeta | None:
        metas = job_candidates((self.view.variants.get(v.job.task) or {}).values(), v.job.tenant)
        chosen = next((m for m in metas if m.variant_id == v.job.variant and m.accuracy >= v.job.min_accuracy), None)
        return chosen or cheapest_variant(metas, v.job.min_accuracy)

    async def _take(self, v: JobView, seen: SeenChunk) -> bool:
        job = v.job
        meta = self._variant(v)
        if meta is None:
            log.warning("job %s: no variant of %s meets %s here", job.job_id, job.task, job.min_accuracy,
                        extra=kv(site=self.site, event="job_no_variant", job=job.job_id))
            return False
        lease = await self._my_lease()
        if not await self.book.claim(job.job_id, seen, self.site, lease):
            return True  # someone else took it: look again
        log.info("job %s chunk %d claimed", job.job_id, seen.chunk.index,
                 extra=kv(site=self.site, event="chunk_claimed", job=job.job_id, chunk=seen.chunk.index))
        try:
            if job.state == "queued":
                with contextlib.suppress(ConflictError):
                    await self.book.set_state(job.job_id, "running", only_from=("queued",))
            compute_before = self.compute_s
            try:
                outputs = await self._run(v, seen, meta, lease)
            except (PermissionDenied, Unauthenticated) as exc:  # the store will not give us its variant (or input)
                self._refused[job.job_id] = time.monotonic() + REFUSED_BACKOFF_S
                log.warning("job %s: the store refused this site variant %s or the input (%s); leaving the job "
                            "for %.0f s",
                            job.job_id, meta.variant_id, exc, REFUSED_BACKOFF_S,
                            extra=kv(site=self.site, event="chunk_variant_refused", job=job.job_id,
                                     chunk=seen.chunk.index))
                await self.book.release(job.job_id, seen.chunk.index, self.site)
                return False
            digest = await self.data.put_bytes(job.tenant, encode_outputs(outputs))
            try:
                await self.book.commit(job.job_id, seen, self.site, digest, meta.variant_id)
            except ConflictError as exc:  # the job ended while the chunk ran (its deadline, a cancel): not ours
                log.info("job %s chunk %d not committed: %s", job.job_id, seen.chunk.index, exc,
                         extra=kv(site=self.site, event="chunk_dropped", job=job.job_id, chunk=seen.chunk.index))
                await self.book.release(job.job_id, seen.chunk.index, self.site)
                return True
        except RequestError as exc:  # the input itself is bad (checked at the door: a store that changed it)
            log.error("job %s chunk %d failed: %s", job.job_id, seen.chunk.index, exc,
                      extra=kv(site=self.site, event="chunk_failed", job=job.job_id))
            with contextlib.suppress(ConflictError):
                await self.book.set_state(job.job_id, "failed", error=f"chunk {seen.chunk.index}: {exc}")
            await self.book.release(job.job_id, seen.chunk.index, self.site)
            return True
        except BaseException:
            with contextlib.suppress(MeshError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await self.book.release(job.job_id, seen.chunk.index, self.site)
            raise
        self.chunks_done += 1
        self.rows_done += seen.chunk.rows
        compute_ms = round((self.compute_s - compute_before) * 1000.0, 3)
        log.info("job %s chunk %d done (%d rows on %s, %.1f ms compute)", job.job_id, seen.chunk.index,
                 seen.chunk.rows, meta.variant_id, compute_ms,
                 extra=kv(site=self.site, event="chunk_done", job=job.job_id, chunk=seen.chunk.index,
                          rows=seen.chunk.rows, variant=meta.variant_id, compute_ms=compute_ms))
        await self.book.finish_if_done(job.job_id)
        return True

    async def _run(self, v: JobView, seen: SeenChunk, meta: VariantMeta, lease: Lease) -> dict[str, np.ndarray]:
        job, c = v.job, seen.chunk
        path = await self.data.get_file(job.tenant, job.input_digest,
                                        self.work_dir / job.tenant / job.input_digest, max_bytes=MAX_INPUT_BYTES)
        x = await asyncio.get_running_loop().run_in_executor(None, read_rows, path, job.input_format, c.start, c.stop)
        topo = self.view.topology
        tenant = topo.tenants.get(job.tenant) if topo is not None else None
        loaded = await self.host.ensure(meta, job.tenant if tenant is not None and tenant.isolation == "strict" else "")
        base = self.host.bases[loaded.base].runtime if loaded.base is not None else None  # a head: its backbone
        tally = ChunkRun()
        try:
            return await run_rows(x, feed(loaded.runtime, meta.inputs[0]["name"] if meta.inputs else "x", base),
                                  batch_rows=self.batch_rows, online_busy=self.online_busy,
                                  lease_alive=lambda: lease.alive, pause_s=self.pause_s,
                                  what=f"chunk {c.index} of job {job.job_id}", tally=tally)
        finally:
            self.compute_s += tally.compute_s
            self.paused_s += tally.paused_s
