"""Offline jobs' records, as etcd holds them (``mesh.etcd.keys.job_key`` / ``chunk_key`` / ``claim_key``) and as the
edge's job API shows them: pure types, their JSON, and chunking.

Units and conventions (one place): times are the writer's wall clock in seconds since the epoch (deadlines are
absolute: a job outlives any one process's monotonic clock; they are compared only with a margin of minutes);
rows are counted from 0 in input order; chunk ``i`` holds rows ``[i * chunk_rows, min((i + 1) * chunk_rows,
rows))``; digests are lowercase sha256 hex of the bytes in the variant store's data area.

A record read from etcd was written by some site (any site may write ``jobs/``, see ``mesh.etcd.rbac``), so it is
decoded as hostile input: :func:`JobRecord.from_json` and :func:`ChunkRecord.from_json` raise ``ProtocolError``
and nothing else whatever the value.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, get_args

from mesh.errors import ProtocolError
from mesh.fields import field as _field
from mesh.fields import integer as _int
from mesh.fields import number as _num
from mesh.fields import record
from mesh.webhooks import parse_target

__all__ = ["CHUNK_STATES", "FORMATS", "JOB_STATES", "SCHEMA", "TERMINAL", "ChunkRecord", "ChunkState", "InputFormat",
           "JobRecord", "JobState", "chunk_rows_of", "dedup_fingerprint", "is_job_id", "plan_chunks"]

SCHEMA = 1
JobState = Literal["queued", "running", "done", "failed", "cancelled"]
ChunkState = Literal["queued", "done", "failed"]
InputFormat = Literal["npz", "jsonl", "oip"]  # oip: the Open Inference Protocol's binary tensor layout
JOB_STATES: tuple[str, ...] = get_args(JobState)
CHUNK_STATES: tuple[str, ...] = get_args(ChunkState)
FORMATS: tuple[str, ...] = get_args(InputFormat)
TERMINAL: frozenset[str] = frozenset({"done", "failed", "cancelled"})
MAX_ROWS = 1 << 40
MAX_CHUNKS = 100_000  # one etcd key per chunk: past this a job would fill etcd with bookkeeping
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_JOB_ID = re.compile(r"^[0-9a-f]{32}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def is_job_id(text: str) -> bool:
    """A job id: 32 lowercase hex characters (a uuid4's hex); also guards keys and paths."""
    return bool(_JOB_ID.match(text))


def plan_chunks(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` row ranges of a job's chunks. ``ValueError`` for a plan that makes no sense."""
    if rows < 1 or chunk_rows < 1:
        raise ValueError(f"a job needs rows >= 1 and chunk rows >= 1, got {rows} and {chunk_rows}")
    n = math.ceil(rows / chunk_rows)
    if n > MAX_CHUNKS:
        raise ValueError(f"{rows} rows in chunks of {chunk_rows} make {n} chunks, over {MAX_CHUNKS}: "
                         f"use chunks of at least {math.ceil(rows / MAX_CHUNKS)} rows")
    return [(i * chunk_rows, min((i + 1) * chunk_rows, rows)) for i in range(n)]


def dedup_fingerprint(task: str, input_format: str, min_accuracy: float, variant: str | None,
                      input_digest: str) -> str:
    """What makes two submissions of one tenant the same work (the same outputs): the task, the input's bytes and
    how to read them, the accuracy floor and the variant chosen for it. Deadline, cost ceiling and chunk size change
    when and where the rows run, not their outputs, so they are not part of it."""
    text = json.dumps([task, input_format, float(min_accuracy).hex(), variant, input_digest])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def chunk_rows_of(rows: int, *, target_chunks: int = 16, lo: int = 256, hi: int = 65_536) -> int:
    """A default chunk size: about ``target_chunks`` chunks (work to spread over sites), each of ``lo``..``hi`` rows
    (a chunk is one claim and one commit in etcd and one output blob: too small costs bookkeeping, too large
    loses more work when its site dies)."""
    return max(lo, min(hi, math.ceil(rows / target_chunks)))


def _choice(d: dict[str, Any], name: str, where: str, allowed: tuple[str, ...]) -> str:
    v = _field(d, name, str, where)
    if v not in allowed:
        raise ProtocolError(f"{where}: {name!r} = {v[:40]!r} is not one of {', '.join(allowed)}")
    return str(v)


def _name(d: dict[str, Any], name: str, where: str) -> str:
    v = _field(d, name, str, where)
    if not _NAME.match(v):
        raise ProtocolError(f"{where}: {name!r} = {v[:40]!r} is not a valid name")
    return str(v)


def _digest(d: dict[str, Any], name: str, where: str, *, optional: bool = False) -> str | None:
    v = d.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not _DIGEST.match(v):
        raise ProtocolError(f"{where}: {name!r} is not a sha256 digest")
    return v


def _object(value: Any, where: str) -> dict[str, Any]:
    return record(value, where, SCHEMA)


@dataclass(frozen=True, slots=True)
class JobRecord:
    """An offline job (``jobs/<id>/job``). ``deadline`` and ``created``/``updated`` are epoch seconds."""

    job_id: str
    task: str
    tenant: str
    min_accuracy: float
    deadline: float
    input_digest: str
    rows: int
    input_format: InputFormat
    chunk_rows: int
    state: JobState = "queued"
    max_cost: float | None = None
    variant: str | None = None  # the variant chosen at admission (cheapest meeting min_accuracy at large batch)
    created: float = 0.0
    updated: float = 0.0
    error: str = ""
    notify: str | None = None  # the https URL told when it ends (canonical, under the tenant's allowed webhooks)

    @property
    def chunks(self) -> list[tuple[int, int]]:
        return plan_chunks(self.rows, self.chunk_rows)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def fingerprint(self) -> str:
        """Its resubmission fingerprint (:func:`dedup_fingerprint`)."""
        return dedup_fingerprint(self.task, self.input_format, self.min_accuracy, self.variant, self.input_digest)

    def with_state(self, state: JobState, now: float, error: str = "") -> JobRecord:
        return replace(self, state=state, updated=now, error=error or self.error)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, value: Any) -> JobRecord:
        where = "job record"
        d = _object(value, where)
        try:
            job_id = _field(d, "job_id", str, where)
            if not is_job_id(job_id):
                raise ProtocolError(f"{where}: 'job_id' is not a job id")
            max_cost = d.get("max_cost")
            variant = d.get("variant")
            if variant is not None and not (isinstance(variant, str) and _NAME.match(variant)):
                raise ProtocolError(f"{where}: 'variant' is not a valid name")
            notify = d.get("notify")
            if notify is not None:
                try:
                    notify = parse_target(notify).text
                except ValueError as exc:
                    raise ProtocolError(f"{where}: 'notify' {exc}") from exc
            rec = cls(job_id=job_id, task=_name(d, "task", where), tenant=_name(d, "tenant", where),
                      min_accuracy=_num(d, "min_accuracy", where, 0.0, 1.0),
                      deadline=_num(d, "deadline", where, 0.0, 1e11),
                      input_digest=_digest(d, "input_digest", where) or "",
                      rows=_int(d, "rows", where, 1, MAX_ROWS),
                      input_format=_choice(d, "input_format", where, FORMATS),  # type: ignore[arg-type]
                      chunk_rows=_int(d, "chunk_rows", where, 1, MAX_ROWS),
                      state=_choice(d, "state", where, JOB_STATES),  # type: ignore[arg-type]
                      max_cost=None if max_cost is None else _num(d, "max_cost", where, 0.0, 1e12),
                      variant=variant,
                      created=_num(d, "created", where, 0.0, 1e11), updated=_num(d, "updated", where, 0.0, 1e11),
                      error=str(_field(d, "error", str, where))[:2000], notify=notify)
            rec.chunks  # noqa: B018  (a plan over MAX_CHUNKS is refused here, not by every reader later)
        except ValueError as exc:  # plan_chunks
            raise ProtocolError(f"{where}: {exc}") from exc
        return rec


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One chunk of a job (``jobs/<id>/chunks/<n>``): done once, with the output's digest and who ran it."""

    index: int
    start: int
    stop: int
    state: ChunkState = "queued"
    site: str | None = None            # the site that committed it
    output_digest: str | None = None   # NPZ with ``y`` (the outputs of rows start..stop-1)
    variant: str | None = None
    error: str = ""

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, value: Any) -> ChunkRecord:
        where = "chunk record"
        d = _object(value, where)
        index = _int(d, "index", where, 0, MAX_CHUNKS)
        start = _int(d, "start", where, 0, MAX_ROWS)
        stop = _int(d, "stop", where, start + 1, MAX_ROWS)
        state = _choice(d, "state", where, CHUNK_STATES)
        site = d.get("site")
        if site is not None and not (isinstance(site, str) and _NAME.match(site)):
            raise ProtocolError(f"{where}: 'site' is not a valid name")
        variant = d.get("variant")
        if variant is not None and not (isinstance(variant, str) and _NAME.match(variant)):
            raise ProtocolError(f"{where}: 'variant' is not a valid name")
        out = _digest(d, "output_digest", where, optional=True)
        if state == "done" and (out is None or site is None):
            raise ProtocolError(f"{where}: a done chunk names its output and its site")
        err = d.get("error", "")
        return cls(index=index, start=start, stop=stop, state=state, site=site,  # type: ignore[arg-type]
                   output_digest=out, variant=variant, error=str(err)[:2000] if isinstance(err, str) else "")
