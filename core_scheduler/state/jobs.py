"""Offline jobs in etcd: creating a job, reading its progress, claiming and committing chunks, cancelling: every
state change a compare-and-swap, so two sites never both commit a chunk and a cancelled job stays cancelled.

Keys (``mesh.etcd.keys``): ``jobs/<id>/job`` (a :class:`~mesh.jobspec.JobRecord`), ``jobs/<id>/chunks/<n>`` (a
:class:`~mesh.jobspec.ChunkRecord`), ``jobs/<id>/claims/<n>`` (``{"site": S}`` under S's lease: a chunk is being
run while its claim exists; the claim of a site that died vanishes with its lease, and the chunk is claimable
again).

Record copies (so a list never reads a chunk): ``jobs/live/<id>`` while the job is queued or running (the chunk
workers' poll, :meth:`JobBook.list` without a tenant) and ``jobs/tenant/<tenant>/<id>`` until retention removes the
job (the job API's list), each written or removed in the same txn as the record. A job written before the copies
existed is listed once :meth:`JobBook.reindex` (the scheduler leader's first sweep) has copied it.

Rules (the CAS each enforces):

- create: chunks first (each only if absent), then the job record (only if absent) with the resubmission index
  entry ``jobs/dedup/<tenant>/<fingerprint>`` naming it: a job is visible only once all its chunks exist;
- claim chunk n: its chunk record unchanged since read (still queued) and no claim on it;
- commit chunk n: its chunk record unchanged since read and the claim is ours; the chunk's done record and the
  claim's removal go in one txn. A second commit of the same chunk loses (the record's revision moved);
- claim and commit also need the job's live copy: a job that turned terminal (done, failed at its deadline,
  cancelled) takes no claim and no commit; a chunk in flight then is not committed (``ConflictError``);
- the job turns ``done`` once every chunk is, ``running`` at its first claim, ``cancelled`` only from a state
  that is not terminal (``ConflictError`` otherwise, which the API answers 409);
- close (the leader's deadline sweep, :meth:`JobBook.close`): its record and the chunks claimed when read are
  unchanged, so a chunk committed meanwhile makes the sweep read again rather than fail a job that just finished;
- remove (retention, :meth:`JobBook.remove`): only a terminal job; its keys go in one range delete, then its copies
  and the resubmission index entry if that still names it.

Every value read back is decoded as hostile (``ProtocolError`` from ``mesh.jobspec``); a list skips what it
cannot read and says so in the log.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from mesh.errors import ConflictError, ProtocolError, RequestError
from mesh.etcd.keys import (
    JOBS,
    JOBS_BY_TENANT,
    JOBS_LIVE,
    assign_key,
    chunk_key,
    claim_key,
    job_dedup_key,
    job_key,
    job_live_key,
    job_prefix,
    job_tenant_key,
    job_tenant_prefix,
)
from mesh.etcd.lease import Lease
from mesh.etcd.ops import KV, MAX_TXN_OPS, Compare, CreateRevision, Delete, ModRevision, Op, Put, ValueEquals, chunk_ops
from mesh.etcd.store import Store
from mesh.jobspec import ChunkRecord, JobRecord, JobState, is_job_id
from mesh.log import get_logger, kv
from mesh.webhooks import NotifyOutcome

__all__ = ["JobBook", "JobView", "SeenChunk"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class SeenChunk:
    """A chunk record as read, with the revision a CAS on it compares, and who claims it now (None: nobody)."""

    chunk: ChunkRecord
    revision: int
    claimed_by: str | None


@dataclass(frozen=True, slots=True)
class JobView:
    """A job with its record's revision and its chunks."""

    job: JobRecord
    revision: int
    chunks: tuple[SeenChunk, ...]
    notified: NotifyOutcome | None = None  # jobs/<id>/notified (core_scheduler.job_notify)
    notifying: bool = False                # a sender holds jobs/<id>/notifying now

    @property
    def notify_status(self) -> str | None:
        """None (no notify URL), ``pending``, ``sending``, ``delivered`` or ``failed``."""
        if self.job.notify is None:
            return None
        if self.notified is not None:
            return self.notified.state
        return "sending" if self.notifying else "pending"

    @property
    def rows_done(self) -> int:
        return sum(c.chunk.rows for c in self.chunks if c.chunk.state == "done")

    @property
    def chunks_done(self) -> int:
        return sum(1 for c in self.chunks if c.chunk.state == "done")

    @property
    def sites(self) -> list[str]:
        """Sites that ran or run its chunks."""
        return sorted({c.chunk.site for c in self.chunks if c.chunk.site} | {c.claimed_by for c in self.chunks
                                                                             if c.claimed_by})

    def to_json(self) -> dict[str, object]:
        j = self.job
        return {"id": j.job_id, "task": j.task, "state": j.state, "rows": j.rows, "rows_done": self.rows_done,
                "chunks": len(self.chunks), "chunks_done": self.chunks_done,
                "progress": self.rows_done / j.rows if j.rows else 0.0, "deadline": j.deadline,
                "min_accuracy": j.min_accuracy, "max_cost": j.max_cost, "variant": j.variant,
                "created": j.created, "updated": j.updated, "error": j.error, "sites": self.sites,
                "input_digest": j.input_digest, "input_format": j.input_format,
                "notify": j.notify, "notify_status": self.notify_status,
                "notify_error": self.notified.error if self.notified is not None else ""}


class JobBook:
    """The job operations over one :class:`Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def create(self, job: JobRecord, *, index_seen: int | None = None) -> None:
        """Write a new job. ``index_seen``: the revision of its resubmission index entry that ``duplicate_of`` saw
        (0: none); if the entry moved since (an identical job was admitted meanwhile), nothing is left written and
        ``ConflictError`` names the entry's key (``details["key"]``), so the caller can answer with that job."""
        chunks = [Put(chunk_key(job.job_id, i), ChunkRecord(i, a, b).to_json()) for i, (a, b) in enumerate(job.chunks)]
        for run in chunk_ops(chunks):
            res = await self.store.txn([CreateRevision(op.key, "==", 0) for op in run], list(run))
            if not res.succeeded:
                raise ConflictError(f"job {job.job_id} already has chunks", key=job_key(job.job_id))
        # with the record, the resubmission index names it (the newest admitted job of that input and request)
        index = job_dedup_key(job.tenant, job.fingerprint)
        guard = [] if index_seen is None else [ModRevision(index, "==", index_seen)]
        res = await self.store.txn([CreateRevision(job_key(job.job_id), "==", 0), *guard],
                                   [*_record_ops(job), Put(index, {"schema": 1, "job": job.job_id})])
        if not res.succeeded:
            if await self.store.get(job_key(job.job_id)) is not None:
                raise ConflictError(f"job {job.job_id} exists already", key=job_key(job.job_id))
            await self.store.delete_prefix(job_prefix(job.job_id))  # its chunks, which no record will ever name
            raise ConflictError(f"an identical job was admitted while job {job.job_id} was", key=index)

    async def record(self, job_id: str) -> tuple[JobRecord, int] | None:
        kv_ = await self.store.get(job_key(job_id))
        if kv_ is None:
            return None
        return JobRecord.from_json(kv_.value), kv_.mod_revision

    async def view(self, job_id: str) -> JobView | None:
        """The job and its chunks (``ProtocolError`` when its record or a chunk cannot be read)."""
        return _assemble(job_id, await self.store.get_prefix(job_prefix(job_id)))

    async def views(self, tenant: str | None = None) -> list[JobView]:
        """Every readable job with its chunks (of ``tenant`` when given), newest first, from one read of ``jobs/``
        (the console's jobs view); a job that cannot be read is skipped and logged."""
        by_job: dict[str, list[KV]] = {}
        for item in await self.store.get_prefix(JOBS):
            job_id = item.key[len(JOBS):].split("/", 1)[0]
            if is_job_id(job_id):  # not jobs/dedup/...
                by_job.setdefault(job_id, []).append(item)
        out = []
        for job_id, items in by_job.items():
            try:
                v = _assemble(job_id, items)
            except ProtocolError as exc:
                log.warning("unreadable job %s: %s", job_id, exc, extra=kv(event="job_unreadable", job=job_id))
                continue
            if v is not None and (tenant is None or v.job.tenant == tenant):
                out.append(v)
        return sorted(out, key=lambda v: -v.job.created)

    async def duplicate_of(self, tenant: str, fingerprint: str) -> tuple[JobRecord | None, int]:
        """``tenant``'s live or done job with this resubmission fingerprint (``mesh.jobspec.dedup_fingerprint``), if
        the index names one and the job's own record agrees (the index is a hint any site may write: the record,
        its tenant and fingerprint decide); None for a failed or cancelled one, which a resubmission runs again.
        With it, the index entry's revision (0: no entry), for ``create(index_seen=)``."""
        got = await self.store.get(job_dedup_key(tenant, fingerprint))
        if got is None:
            return None, 0
        return await self._indexed(tenant, fingerprint, got), got.mod_revision

    async def _indexed(self, tenant: str, fingerprint: str, got: KV) -> JobRecord | None:
        value = got.value
        job_id = value.get("job") if isinstance(value, dict) and value.get("schema") == 1 else None
        if not isinstance(job_id, str) or not is_job_id(job_id):
            log.warning("unreadable job dedup entry %s", got.key, extra=kv(event="job_unreadable", tenant=tenant))
            return None
        try:
            found = await self.record(job_id)
        except ProtocolError as exc:
            log.warning("unreadable job %s: %s", job_id, exc, extra=kv(event="job_unreadable", job=job_id))
            return None
        if found is None:
            return None
        rec = found[0]
        if rec.tenant != tenant or rec.fingerprint != fingerprint or rec.state not in ("queued", "running", "done"):
            return None
        return rec

    async def records(self) -> list[JobRecord]:
        """Every job of every tenant, from the tenants' copies (the leader's retention sweep), newest first."""
        return sorted(_copies(await self.store.get_prefix(JOBS_BY_TENANT), JOBS_BY_TENANT, None),
                      key=lambda r: -r.created)

    async def list(self, tenant: str | None = None) -> list[JobRecord]:
        """``tenant``'s jobs, every state (the job API's list), or without a tenant every live job: queued or
        running, of all tenants (the chunk workers' poll); newest first. Reads record copies only, never a chunk."""
        prefix = JOBS_LIVE if tenant is None else job_tenant_prefix(tenant)
        return sorted(_copies(await self.store.get_prefix(prefix), prefix, tenant), key=lambda r: -r.created)

    async def reindex(self) -> int:
        """Copy the record of each job written before the copies existed (one read of ``jobs/`` whole); returns how
        many copies it wrote. Each copy is written only if absent and while its record is unchanged."""
        wrote = 0
        items = await self.store.get_prefix(JOBS)
        have = {item.key for item in items}
        for item in items:
            job_id = item.key[len(JOBS):].split("/", 1)[0]
            if not (is_job_id(job_id) and item.key == job_key(job_id)):
                continue
            try:
                rec = JobRecord.from_json(item.value)
            except ProtocolError as exc:
                log.warning("unreadable job record %s: %s", item.key, exc, extra=kv(event="job_unreadable"))
                continue
            want = [k for k in (job_tenant_key(rec.tenant, job_id), None if rec.terminal else job_live_key(job_id))
                    if k is not None and k not in have]
            if want:
                res = await self.store.txn([ModRevision(item.key, "==", item.mod_revision),
                                            *(CreateRevision(k, "==", 0) for k in want)],
                                           [Put(k, rec.to_json()) for k in want])
                wrote += len(want) if res.succeeded else 0
        return wrote

    async def set_state(self, job_id: str, state: JobState, *, error: str = "",
                        only_from: tuple[str, ...] = ("queued", "running")) -> JobRecord:
        """Move a job to ``state`` from one of ``only_from`` (CAS on its record); ``ConflictError`` otherwise."""
        for _ in range(5):  # another writer moved it between our read and write: read again
            got = await self.record(job_id)
            if got is None:
                raise RequestError(f"no job {job_id}")
            rec, rev = got
            if rec.state == state:
                return rec
            if rec.state not in only_from:
                raise ConflictError(f"job {job_id} is {rec.state}: it cannot become {state}", state=rec.state)
            new = rec.with_state(state, time.time(), error)
            res = await self.store.txn([ModRevision(job_key(job_id), "==", rev)], _record_ops(new))
            if res.succeeded:
                log.info("job %s -> %s", job_id, state, extra=kv(event="job_state", job=job_id, state=state))
                return new
        raise ConflictError(f"job {job_id} kept changing under us")

    async def claim(self, job_id: str, seen: SeenChunk, site: str, lease: Lease) -> bool:
        """Claim a queued chunk for ``site`` under ``lease``; False when someone else changed or claimed it."""
        if seen.chunk.state != "queued":
            return False
        ck = claim_key(job_id, seen.chunk.index)
        res = await self.store.txn([ModRevision(chunk_key(job_id, seen.chunk.index), "==", seen.revision),
                                    CreateRevision(ck, "==", 0), CreateRevision(job_live_key(job_id), ">", 0)],
                                   [Put(ck, {"site": site}, lease=lease)])
        return res.succeeded

    async def commit(self, job_id: str, seen: SeenChunk, site: str, output_digest: str, variant: str) -> ChunkRecord:
        """Commit a chunk ``site`` claimed as done with its output (once: ``ConflictError`` for a second commit,
        a chunk changed since ``seen``, a claim that is not ``site``'s any more, or a job no longer live: one that
        failed at its deadline or was cancelled while the chunk ran)."""
        done = replace(seen.chunk, state="done", site=site, output_digest=output_digest, variant=variant)
        ck, cl = chunk_key(job_id, seen.chunk.index), claim_key(job_id, seen.chunk.index)
        res = await self.store.txn([ModRevision(ck, "==", seen.revision), ValueEquals(cl, {"site": site}),
                                    CreateRevision(job_live_key(job_id), ">", 0)],
                                   [Put(ck, done.to_json()), Delete(cl)])
        if not res.succeeded:
            raise ConflictError(f"chunk {seen.chunk.index} of job {job_id} changed, is not {site}'s to commit, "
                                f"or the job is over", key=ck)
        return done

    async def release(self, job_id: str, index: int, site: str) -> None:
        """Give a claim back (the site is busy with online work again, or stopping), if it is still ours."""
        cl = claim_key(job_id, index)
        await self.store.txn([ValueEquals(cl, {"site": site})], [Delete(cl)])

    async def finish_if_done(self, job_id: str) -> bool:
        """Turn the job ``done`` when every chunk is (idempotent); True if it is done now."""
        v = await self.view(job_id)
        if v is None or v.job.state in ("cancelled", "failed"):
            return False
        if v.chunks_done < len(v.chunks):
            return False
        try:
            await self.set_state(job_id, "done")
        except ConflictError:
            return False
        return True


    async def close(self, v: JobView, state: JobState, error: str, now: float) -> JobRecord | None:
        """Make the job ``v`` shows terminal (the deadline sweep: ``failed``, or ``done`` when its last chunk is)
        if nothing that matters moved since ``v`` was read: its record, and the chunks claimed then (a claimed
        chunk is the only kind that can be committed). None when something did: read again and decide again.
        Once closed, no claim or commit of the job succeeds (its live copy is gone in the same txn)."""
        if v.job.terminal:
            return None
        claimed = [c for c in v.chunks if c.claimed_by is not None and c.chunk.state == "queued"]
        guard: list[Compare] = [ModRevision(job_key(v.job.job_id), "==", v.revision)]
        guard += [ModRevision(chunk_key(v.job.job_id, c.chunk.index), "==", c.revision)
                  for c in claimed[:MAX_TXN_OPS - 1]]  # one claim per working site: far fewer in practice
        new = v.job.with_state(state, now, error)
        if not (await self.store.txn(guard, _record_ops(new))).succeeded:
            return None
        log.info("job %s -> %s: %s", new.job_id, state, error, extra=kv(event="job_state", job=new.job_id,
                                                                         state=state))
        return new

    async def remove(self, rec: JobRecord) -> bool:
        """Remove a terminal job's keys (record, chunks, claims, notifications, its assignments under
        ``jobassign/``, copies, and the resubmission index entry if it still names the job); False (nothing
        removed) when its record says it is not terminal. Its keys go first, in range deletes, and the copies
        after: should this stop between the two, the tenant copy still names the job and the next sweep finishes
        the removal."""
        got = await self.record(rec.job_id)
        if got is not None and not got[0].terminal:
            return False
        await self.store.delete_prefix(job_prefix(rec.job_id))
        await self.store.delete_prefix(assign_key(rec.job_id))  # the scheduler's (retention runs there): RBAC
        index = job_dedup_key(rec.tenant, rec.fingerprint)
        await self.store.txn([ValueEquals(index, {"schema": 1, "job": rec.job_id})], [Delete(index)])
        await self.store.txn([], [Delete(job_tenant_key(rec.tenant, rec.job_id)), Delete(job_live_key(rec.job_id))])
        log.info("job %s removed", rec.job_id, extra=kv(event="job_removed", job=rec.job_id, tenant=rec.tenant))
        return True


def _record_ops(rec: JobRecord) -> list[Op]:
    """Write a job's record and its copies: the tenant's always, the live one only while it is not terminal."""
    value = rec.to_json()
    live: Op = Delete(job_live_key(rec.job_id)) if rec.terminal else Put(job_live_key(rec.job_id), value)
    return [Put(job_key(rec.job_id), value), Put(job_tenant_key(rec.tenant, rec.job_id), value), live]


def _copies(items: list[KV], prefix: str, tenant: str | None) -> list[JobRecord]:
    """The readable record copies under ``prefix`` (a copy must sit at its own job's key, and a tenant's list holds
    that tenant's jobs only); what cannot be read is skipped and logged."""
    out = []
    for item in items:
        try:
            rec = JobRecord.from_json(item.value)
        except ProtocolError as exc:
            log.warning("unreadable job record copy %s: %s", item.key, exc, extra=kv(event="job_unreadable"))
            continue
        at = job_live_key(rec.job_id) if prefix == JOBS_LIVE else job_tenant_key(rec.tenant, rec.job_id)
        if item.key != at or (tenant is not None and rec.tenant != tenant):
            log.warning("job record copy %s names job %s of %s", item.key, rec.job_id, rec.tenant,
                        extra=kv(event="job_unreadable"))
            continue
        out.append(rec)
    return out


def _assemble(job_id: str, kvs: list[KV]) -> JobView | None:
    """One job's view from the keys under ``jobs/<id>/`` (``ProtocolError`` when a record cannot be read)."""
    job: tuple[JobRecord, int] | None = None
    chunks: dict[int, tuple[ChunkRecord, int]] = {}
    claims: dict[int, str] = {}
    notified: NotifyOutcome | None = None
    notifying = False
    for item in kvs:
        tail = item.key[len(JOBS) + len(job_id) + 1:]
        if tail == "job":
            job = JobRecord.from_json(item.value), item.mod_revision
        elif tail.startswith("chunks/"):
            c = ChunkRecord.from_json(item.value)
            if chunk_key(job_id, c.index) != item.key:
                raise ProtocolError(f"chunk record at {item.key} says it is chunk {c.index}")
            chunks[c.index] = c, item.mod_revision
        elif tail == "notified":
            notified = NotifyOutcome.from_json(item.value)
        elif tail == "notifying":
            notifying = True
        elif tail.startswith("claims/") and isinstance(item.value, dict) \
                and isinstance(item.value.get("site"), str):
            idx = tail.removeprefix("claims/")
            if idx.isdigit() and len(idx) == 6:
                claims[int(idx)] = item.value["site"][:128]
    if job is None:
        return None
    plan = job[0].chunks
    if sorted(chunks) != list(range(len(plan))) or any(
            (c.start, c.stop) != plan[i] for i, (c, _) in chunks.items()):
        raise ProtocolError(f"job {job_id}: its chunks do not match its plan of {len(plan)} chunks")
    seen = tuple(SeenChunk(c, rev, claims.get(i)) for i, (c, rev) in sorted(chunks.items()))
    return JobView(job[0], job[1], seen, notified, notifying)
