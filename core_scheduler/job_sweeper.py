"""The scheduler leader's sweep of offline jobs, once per round: a job its deadline passed turns terminal, and a
finished job is removed, keys and data, once its retention is over.

Deadlines. A job not finished ``grace_s`` after its deadline is closed by compare-and-swap
(``JobBook.close``): ``failed``, with an error saying when and how far it got, or ``done`` when its last chunk was
committed meanwhile (a job that finished stays done; a cancelled one stays cancelled: only a live job is closed).
Closing removes the job's live copy in the same txn, so no site claims its chunks after, and a chunk in flight is
not committed (its commit needs the live copy): its rows are lost with the job, which is what failing means.
``failed`` rather than a new ``expired`` state: the API's states stay those the SDK and CLI know, and the error says
why. The grace (``DEADLINE_GRACE_S``) lets a chunk that is committing at the deadline land.

Retention. A terminal job whose last change (``updated``) is ``retention_s`` old is removed: first its data in the
variant store's data area (its input and chunk outputs), then its etcd keys (``JobBook.remove``), so a sweep that
stops half-way leaves a job that the next one finds again, never data that no record names. An object is deleted
only when no job that stays names it: two jobs of a tenant share an input when it was submitted twice, and their
chunk outputs too when the rows and the variant match (so the outputs of jobs with the same input are read). A
job admitted after the snapshot this sweep decided on is covered by the store: it refuses to delete an object
stored (again) within ``DATA_MIN_AGE_S`` (``variant_store.data_area``), and the job that named it then stays
until a later sweep, so that no object is left that no job names.

The rules are pure functions over records and views (:func:`late`, :func:`closing`, :func:`expired`,
:func:`sharing`, :func:`removable`); :func:`sweep_once` does the I/O. Each job's failure is logged and reported,
never raised: one unreadable job does not stop the sweep of the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from core_scheduler.state.jobs import JobBook, JobView
from mesh.errors import ConflictError, MeshError
from mesh.jobspec import JobRecord, JobState
from mesh.log import get_logger, kv

__all__ = ["DATA_MIN_AGE_S", "DEADLINE_GRACE_S", "DEFAULT_RETENTION_S", "MAX_REMOVALS", "DataRemover", "Sweep",
           "closing", "deadline_error", "expired", "late", "removable", "sharing", "sweep_once"]

log = get_logger(__name__)
DEADLINE_GRACE_S = 30.0  # a chunk committing as the deadline passes lands (a chunk's commit takes milliseconds)
DEFAULT_RETENTION_S = 7 * 86_400.0
# an object stored within this window is kept whatever the sweep decided: a door stores a job's input, then admits
# the job, within seconds; minutes leave room for a slow etcd
DATA_MIN_AGE_S = 300.0
MAX_REMOVALS = 50  # jobs removed per sweep: one leader round does bounded work, the next goes on
_CLOSE_TRIES = 3

Ref = tuple[str, str]  # (tenant, digest): data is private to a tenant, so a digest is shared only within one


class DataRemover(Protocol):
    """What the sweep needs of the data area (``edge_agent.job_data.DataClient`` with a scheduler certificate)."""

    async def delete(self, tenant: str, digest: str, *, min_age_s: float = 0.0) -> int | None: ...


@dataclass
class Sweep:
    """What one sweep did: jobs failed at their deadline, found done instead, removed; data deleted (and bytes),
    data kept because it was still in use, and what could not be done this time (retried at the next sweep)."""

    failed: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    data_removed: list[Ref] = field(default_factory=list)
    bytes_freed: int = 0
    data_kept: list[Ref] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# -- pure rules ------------------------------------------------------------------------------------------------------
def late(records: Iterable[JobRecord], now: float, grace_s: float = DEADLINE_GRACE_S) -> list[JobRecord]:
    """The live jobs whose deadline passed more than ``grace_s`` ago, the earliest deadline first."""
    return sorted((r for r in records if not r.terminal and now > r.deadline + grace_s), key=lambda r: r.deadline)


def deadline_error(job: JobRecord, rows_done: int) -> str:
    """Why a job failed at its deadline, and how far it got."""
    when = datetime.fromtimestamp(job.deadline, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"deadline passed at {when}: {rows_done} of {job.rows} rows done"


def closing(v: JobView) -> tuple[JobState, str]:
    """What a late job becomes: ``done`` when every chunk is (its last commit beat the sweep), else ``failed``."""
    if v.chunks and v.chunks_done == len(v.chunks):
        return "done", ""
    return "failed", deadline_error(v.job, v.rows_done)


def expired(records: Iterable[JobRecord], now: float, retention_s: float) -> list[JobRecord]:
    """The terminal jobs last changed ``retention_s`` or more ago, oldest first."""
    return sorted((r for r in records if r.terminal and now - r.updated >= retention_s), key=lambda r: r.updated)


def sharing(gone: Iterable[JobRecord], kept: Iterable[JobRecord]) -> list[JobRecord]:
    """The kept jobs whose chunk outputs a removed job may share: same tenant and input (identical rows through
    the same variant make identical output objects). Only their chunks need reading."""
    inputs = {(r.tenant, r.input_digest) for r in gone}
    return [r for r in kept if (r.tenant, r.input_digest) in inputs]


def removable(gone: Mapping[str, tuple[str, Iterable[str]]], kept: Iterable[JobRecord],
              kept_outputs: Iterable[Ref] = ()) -> tuple[list[Ref], list[Ref]]:
    """Which data the removed jobs (``gone``: job id -> (tenant, digests it names)) leave behind may be deleted,
    and which must stay because a kept job names it (as its input, or as a chunk output in ``kept_outputs``).
    Both sorted, each object once."""
    named = {(tenant, d) for tenant, digests in gone.values() for d in digests}
    used = {(r.tenant, r.input_digest) for r in kept} | set(kept_outputs)
    return sorted(named - used), sorted(named & used)


# -- the sweep -------------------------------------------------------------------------------------------------------
async def sweep_once(book: JobBook, data: DataRemover | None, now: float,
                     retention_s: float = DEFAULT_RETENTION_S, *, grace_s: float = DEADLINE_GRACE_S,
                     max_removals: int = MAX_REMOVALS, data_min_age_s: float = DATA_MIN_AGE_S,
                     reindex: bool = False) -> Sweep:
    """One sweep at wall-clock time ``now`` (epoch seconds). ``data``: the data area's client; None (no store
    announced yet) defers every removal. ``reindex``: first copy the records of jobs written before the record
    copies existed (``JobBook.reindex``: one read of ``jobs/`` whole; the leader's first sweep)."""
    out = Sweep()
    if reindex:
        await book.reindex()
    for rec in late(await book.list(), now, grace_s):
        await _close(book, rec.job_id, now, out)
    if data is None:
        return out
    records = await book.records()
    gone = expired(records, now, retention_s)[:max_removals]
    if gone:
        ids = {r.job_id for r in gone}
        await _remove(book, data, gone, [r for r in records if r.job_id not in ids], data_min_age_s, out)
    return out


async def _close(book: JobBook, job_id: str, now: float, out: Sweep) -> None:
    try:
        for _ in range(_CLOSE_TRIES):  # a chunk committed between our read and our CAS: read and decide again
            v = await book.view(job_id)
            if v is None or v.job.terminal:
                return
            state, error = closing(v)
            if await book.close(v, state, error, now) is not None:
                (out.failed if state == "failed" else out.finished).append(job_id)
                return
        out.errors.append(f"job {job_id}: kept changing while its deadline passed; next sweep")
    except MeshError as exc:
        log.warning("job %s: deadline sweep failed: %s", job_id, exc, extra=kv(event="job_sweep_failed", job=job_id))
        out.errors.append(f"job {job_id}: {exc}")


async def _outputs(book: JobBook, rec: JobRecord) -> list[str] | None:
    """The output digests a job's chunks name; None when they cannot be read."""
    try:
        v = await book.view(rec.job_id)
    except MeshError as exc:
        log.warning("job %s unreadable: %s", rec.job_id, exc, extra=kv(event="job_unreadable", job=rec.job_id))
        return None
    return [] if v is None else [c.chunk.output_digest for c in v.chunks if c.chunk.output_digest]


async def _remove(book: JobBook, data: DataRemover, gone: list[JobRecord], kept: list[JobRecord],
                  min_age_s: float, out: Sweep) -> None:
    named: dict[str, tuple[str, list[str]]] = {}
    for rec in gone:
        outputs = await _outputs(book, rec)
        # an unreadable chunk (a site wrote junk): its input still goes, its outputs stay (named by nothing, kept)
        named[rec.job_id] = (rec.tenant, [rec.input_digest, *(outputs or [])])
    kept_outputs: list[Ref] = []
    for rec in sharing(gone, kept):
        outputs = await _outputs(book, rec)
        if outputs is None:  # cannot tell what it shares: keep every output of the jobs with its input
            kept_outputs += [(t, d) for t, ds in named.values() if t == rec.tenant for d in ds]
        kept_outputs += [(rec.tenant, d) for d in outputs or []]
    delete, out.data_kept = removable(named, kept, kept_outputs)
    failed: set[Ref] = set()
    for tenant, digest in delete:
        try:
            freed = await data.delete(tenant, digest, min_age_s=min_age_s)
        except ConflictError:  # stored again since the snapshot: a new job may use it. The job's keys stay too, so
            out.data_kept.append((tenant, digest))  # a later sweep deletes it should no job name it by then
            failed.add((tenant, digest))
            continue
        except MeshError as exc:  # the store is away: this job's keys stay, so the next sweep tries again
            log.warning("job data %s of %s not deleted: %s", digest[:12], tenant, exc,
                        extra=kv(event="job_sweep_failed", tenant=tenant))
            out.errors.append(f"data {digest[:12]} of {tenant}: {exc}")
            failed.add((tenant, digest))
            continue
        out.data_removed.append((tenant, digest))
        out.bytes_freed += freed or 0
    for rec in gone:
        tenant, digests = named[rec.job_id]
        if any((tenant, d) in failed for d in digests):
            continue
        try:
            if await book.remove(rec):
                out.removed.append(rec.job_id)
        except MeshError as exc:
            log.warning("job %s not removed: %s", rec.job_id, exc, extra=kv(event="job_sweep_failed", job=rec.job_id))
            out.errors.append(f"job {rec.job_id}: {exc}")
