"""Which tenant-private variants each site may fetch because the scheduler leader assigned it chunks of an offline
job: the records under etcd ``jobassign/`` (:data:`mesh.etcd.keys.JOB_ASSIGN`, written by the scheduler role only:
etcd RBAC, :mod:`mesh.etcd.rbac`; a site can read them and never write them), and for :data:`GRACE_S` after one is
removed.

Why: placement (:mod:`variant_store.placed`) asks a site for a tenant's variant only when online traffic wants it
there, and a job's chunks go to idle, cheap sites, which placement mostly has not given a variant of the job's
tenant. Without this, such a site claims the chunk, is refused the blob (403) and releases it, over and over.

The record (``core_scheduler.state.job_assign`` writes it, both read it through :func:`decode_record`)::

    jobassign/<job id>/<n:06d> = {"schema": 1, "site": S, "since": t0, "at": t, "leader": R,
                                  "tenant": T, "task": K, "variant": V}

It grants exactly that variant: site S may read the catalog entry and blobs (its ONNX, its shared backbone) of
variant V of task K while V is tenant T's (the catalog's owner must be T: a record naming another tenant's variant
grants nothing). Not T's other variants: a chunk runs on the one variant the job chose. A record that does not
decode (or lacks the tenant, task and variant) grants nothing.

Timing, as for placement: the store reads ``jobassign/`` from etcd at the question (a linearizable get), so a site
that just saw its assignment can never fetch before the store knows; the leader removes an assignment as soon as the
chunk is claimed (the claimer then fetches), done, or its site left, so a removal starts a grace of
:data:`GRACE_S` remembered from a watch (bounded: only removals within the grace are kept; a store that restarts
forgets them, and a refused site releases the chunk and backs off, ``edge_agent.chunks``).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mesh.backoff import Backoff
from mesh.errors import ProtocolError
from mesh.etcd.keys import JOB_ASSIGN
from mesh.etcd.store import Store
from mesh.etcd.watch import KeyRange
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["GRACE_S", "SCHEMA", "AssignRecord", "Granted", "JobGrants", "decode_record", "split_key"]

log = get_logger(__name__)
Granted = tuple[str, str, str]  # (tenant, task, variant id) a site's job assignments let it fetch
GRACE_S = 300.0  # as placement's: a large blob's fetch right after the claim, resumed, fits
SCHEMA = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a site, tenant, task or variant name (as mesh.jobspec)
_MAX_TIME = 1e11  # epoch seconds, as mesh.jobspec bounds a deadline


@dataclass(frozen=True, slots=True)
class AssignRecord:
    """One decoded assignment: chunk of a job to ``site``, handed out at ``since``, renewed at ``at`` (the leader's
    wall clock, epoch seconds); ``variant``: what it lets ``site`` fetch (None: the record names none)."""

    site: str
    since: float
    at: float
    variant: Granted | None


def _time(d: dict[str, Any], name: str, where: str) -> float:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0.0 <= v <= _MAX_TIME:
        raise ProtocolError(f"{where}: {name!r} is not a time")
    return float(v)


def _name(d: dict[str, Any], name: str, where: str) -> str:
    v = d.get(name)
    if not isinstance(v, str) or not _NAME.match(v):
        raise ProtocolError(f"{where}: {name!r} is not a name")
    return v


def split_key(key: str) -> tuple[str, int]:
    """``jobassign/<job>/<n:06d>`` -> (job id, n); ``ProtocolError`` for any other key."""
    job, sep, tail = key.removeprefix(JOB_ASSIGN).partition("/")
    if not key.startswith(JOB_ASSIGN) or not sep or not job or not (tail.isascii() and tail.isdigit()
                                                                         and len(tail) == 6):
        raise ProtocolError(f"assignment {key}: not a chunk's assignment key")
    return job, int(tail)


def decode_record(where: str, value: Any) -> AssignRecord:
    """An assignment's value, read as hostile (etcd's bytes, however RBAC guards them); ``ProtocolError`` for
    anything but a schema-1 object with a site and times. The tenant, task and variant are optional (a record
    without them grants nothing) but must be names when present."""
    try:
        if not isinstance(value, dict) or value.get("schema") != SCHEMA:
            raise ProtocolError(f"{where}: not a schema {SCHEMA} object")
        site = _name(value, "site", where)
        since, at = _time(value, "since", where), _time(value, "at", where)
        named = [k for k in ("tenant", "task", "variant") if k in value]
        variant = None
        if named:
            variant = (_name(value, "tenant", where), _name(value, "task", where), _name(value, "variant", where))
        return AssignRecord(site, min(since, at), at, variant)
    except ProtocolError:
        raise
    except Exception as exc:  # anything else a hostile value raises (RecursionError, OverflowError...)
        raise ProtocolError(f"{where}: unreadable ({type(exc).__name__})") from exc


def _grant(key: str, value: Any) -> tuple[str, Granted] | None:
    """(site, variant) that assignment ``key`` = ``value`` grants; None (logged) for one that grants nothing."""
    try:
        split_key(key)
        rec = decode_record(f"assignment {key}", value)
    except ProtocolError as exc:
        log.warning("unreadable job assignment: %s", exc, extra=kv(event="job_grant_unreadable"))
        return None
    return None if rec.variant is None else (rec.site, rec.variant)


class JobGrants(Service):
    """What assignments let each site fetch now (read from etcd at each question) and until recently (followed
    through a watch on ``jobassign/``)."""

    def __init__(self, store: Store, *, grace_s: float = GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.grace_s, self._clock = store, grace_s, clock
        self._held: dict[str, tuple[str, Granted]] = {}  # key -> (site, variant), as the watch last saw it
        self._gone: dict[tuple[str, Granted], float] = {}  # (site, variant) -> when its last assignment went
        self._task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="job-grants")

    async def _stop(self) -> None:
        await cancel_and_wait(self._task)

    async def granted(self, site: str) -> frozenset[Granted]:
        """The variants ``site`` may fetch for its job chunks: those its assignments in etcd name now and those
        they named until less than ``grace_s`` ago."""
        items = await self.store.get_prefix(JOB_ASSIGN)
        now_held = {g for item in items if (g := _grant(item.key, item.value)) is not None}
        return self.of(site, now_held)

    def of(self, site: str, now_held: set[tuple[str, Granted]] | frozenset[tuple[str, Granted]] = frozenset()
           ) -> frozenset[Granted]:
        """``site``'s grants from ``now_held`` (a fresh read) with what the watch holds (a removal it has not
        delivered yet has not started its grace) and removals within the grace."""
        now = self._clock()
        out = {v for s, v in now_held if s == site} | {v for s, v in self._held.values() if s == site}
        out |= {v for (s, v), left in self._gone.items() if s == site and now - left <= self.grace_s}
        return frozenset(out)

    def record(self, key: str, grant: tuple[str, Granted] | None) -> None:
        """Assignment ``key`` now grants ``grant`` (None: removed, or grants nothing): what it granted before
        starts its grace, unless another assignment still grants it."""
        now = self._clock()
        before = self._held.pop(key, None)
        if grant is not None:
            self._held[key] = grant
            self._gone.pop(grant, None)
        if before is not None and before != grant and before not in self._held.values():
            self._gone[before] = now
        for g, left in list(self._gone.items()):  # bounded: only what left within the grace is kept
            if now - left > self.grace_s:
                del self._gone[g]

    async def _follow(self) -> None:
        """Read every assignment, then watch from that revision; on any failure read again after a back-off (an
        assignment removed while the watch was down starts its grace at the re-read). Never returns."""
        backoff = Backoff(0.25, 5.0)
        while True:
            try:
                revision = await self.store.revision()
                current = {item.key: _grant(item.key, item.value) for item in await self.store.get_prefix(JOB_ASSIGN)}
                for key in set(self._held) | set(current):
                    self.record(key, current.get(key))
                async with self.store.watch_ranges([KeyRange.under(JOB_ASSIGN)], start_revision=revision + 1) as w:
                    async for ev in w:
                        backoff.reset()
                        self.record(ev.key, _grant(ev.key, ev.value) if ev.kind == "put" else None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("following %s failed; reading it again", JOB_ASSIGN,
                            extra=kv(event="job_grants_follow_retry", reason=str(exc)[:300]))
            await asyncio.sleep(backoff.next())
