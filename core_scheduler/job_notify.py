"""Job notifications by webhook (issue 32 item 4), sent by the scheduler leader when a job ends.

A job submitted with ``notify=<url>`` (checked at the door against the tenant's ``webhooks`` in the topology,
``mesh.webhooks``) is told once it is ``done``, ``failed`` or ``cancelled``: one HTTPS ``POST`` of a JSON body (the
job's id, task, tenant, state, rows, rows done, error, and its result's path when it is done; see :func:`payload`)
with the header ``X-Tiermesh-Delivery: <job id>`` a receiver may deduplicate on. The leader calls
:meth:`JobNotifier.notify_once` each round; the deliveries run as tasks the notifier owns, so a slow receiver
never holds a round up.

Rules of one delivery:

- the URL is checked again **at send time**, before every attempt, against the tenant's allow-list as the leader
  sees it now (an operator may have removed the prefix since the job was submitted); no longer allowed: nothing is
  sent and the job says ``failed`` with the reason;
- HTTPS only, the receiver's certificate verified (the tenant's ``webhook_ca`` from the topology, else the system's
  trust store, else the notifier's ``cafile``), redirects never followed (a 3xx is a failure: following one would
  reach a URL nobody allowed), no proxy from the environment, ``timeout_s`` for each attempt;
- at most ``attempts`` attempts, ``mesh.backoff`` delays between them; a 2xx is delivered, a 408, 425, 429 or 5xx
  or a connection failure is tried again, any other status ends the delivery as failed.

Exactly-once-ish, in etcd beside the job (``mesh.etcd.keys.job_notify_key``): a sender first creates
``jobs/<id>/notifying`` under its own lease (only while neither it nor ``jobs/<id>/notified`` exists), then sends,
then writes ``notified`` (:class:`~mesh.webhooks.NotifyOutcome`) and deletes its claim in one txn guarded by the
claim being still its own. A new leader therefore never resends what was recorded, and never sends while an old
leader that still lives is sending; a leader that dies mid-send leaves a claim that vanishes with its lease, and the
next one sends again (a receiver may then see a second POST with the same delivery id: "ish"). A failed delivery is
recorded too, with its reason; the job's JSON shows both (``notify_status``, ``notify_error``).

Not built: an HMAC signature of the body (a per-tenant secret has no place yet: the topology is readable by every
site).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import ssl
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from core_scheduler.state.jobs import JobBook, JobView
from mesh.backoff import Backoff
from mesh.errors import StoreError
from mesh.etcd.keys import job_notify_key
from mesh.etcd.lease import Lease
from mesh.etcd.ops import CreateRevision, Delete, Put, ValueEquals
from mesh.etcd.store import Store
from mesh.jobspec import JobRecord
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from mesh.webhooks import NotifyOutcome, WebhookUrl, allowed_target
from topology.schema import Tenant

__all__ = ["DELIVERY_HEADER", "JobNotifier", "NotifyConfig", "due", "payload", "retryable"]

log = get_logger(__name__)
DELIVERY_HEADER = "X-Tiermesh-Delivery"
MAX_REMEMBERED = 100_000  # settled job ids kept in memory between rounds
Tenants = Callable[[], Mapping[str, Tenant]]


@dataclass(frozen=True, slots=True)
class NotifyConfig:
    """``attempts`` per delivery, each bounded by ``timeout_s``; back-off from ``backoff_base_s`` to
    ``backoff_cap_s`` between them (the defaults give up within about a minute); ``claim_ttl_s``: the lease of this
    sender's claims (how long a dead leader's delivery blocks a resend); at most ``max_in_flight`` at once."""

    attempts: int = 4
    timeout_s: float = 10.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 10.0
    claim_ttl_s: float = 15.0
    max_in_flight: int = 16


# -- pure decisions --------------------------------------------------------------------------------------------
def due(jobs: Iterable[JobRecord], settled: Collection[str], busy: Collection[str]) -> list[JobRecord]:
    """The jobs to notify now: ended, with a notify URL, neither ``settled`` (a ``notified`` record exists) nor
    ``busy`` (claimed by a sender, or in flight here); the longest-ended first."""
    out = [j for j in jobs if j.terminal and j.notify is not None and j.job_id not in settled
           and j.job_id not in busy]
    return sorted(out, key=lambda j: (j.updated, j.job_id))


def retryable(status: int) -> bool:
    """Whether an HTTP status may change if asked again (timeouts, rate limits, the receiver's own errors)."""
    return status in (408, 425, 429) or 500 <= status <= 599


def payload(view: JobView) -> dict[str, Any]:
    """The body of a job's notification (JSON)."""
    j = view.job
    return {"schema": 1, "event": "job.ended", "id": j.job_id, "task": j.task, "tenant": j.tenant, "state": j.state,
            "rows": j.rows, "rows_done": view.rows_done, "error": j.error, "ended_at": j.updated,
            "result": f"/v2/models/{j.task}/jobs/{j.job_id}/result" if j.state == "done" else None}


# -- the sender ------------------------------------------------------------------------------------------------
class JobNotifier(Service):
    """Sends the notifications of ended jobs. ``tenants()``: the tenants as the leader sees them now (its
    ``MeshView.tenants``); ``owner``: who sends (the scheduler's candidate id), written in its claims;
    ``cafile``: a PEM bundle trusted besides the system's when a tenant names no ``webhook_ca``."""

    def __init__(self, store: Store, tenants: Tenants, owner: str, cfg: NotifyConfig | None = None, *,
                 cafile: str | None = None) -> None:
        self.store, self.tenants, self.owner = store, tenants, owner
        self.cfg = cfg or NotifyConfig()
        self.cafile = cafile
        self.book = JobBook(store)
        self.sent = 0  # POSTs made (attempts), for tests and metrics
        self._lease: Lease | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._settled: set[str] = set()  # jobs whose notification is recorded (delivered or failed): final

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(trust_env=False)  # no proxy from the environment: the URL is the URL

    async def _stop(self) -> None:
        await cancel_and_wait(*self._tasks.values())
        self._tasks.clear()
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(StoreError, TimeoutError):
                await lease.revoke()  # our claims vanish now: a delivery cut short is resent by whoever leads

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def drain(self) -> None:
        """Wait until the deliveries in flight have ended (tests; a leader stepping down in good order)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    async def notify_once(self) -> int:
        """Start the deliveries that are due (at most ``max_in_flight`` in flight); how many were started."""
        self._require_running("notify_once")
        room = self.cfg.max_in_flight - len(self._tasks)
        if room <= 0:
            return 0
        records, settled, claimed = await self._read()
        start = due(records, settled, claimed | set(self._tasks))[:room]
        if not start:
            return 0
        lease = await self._claim_lease()
        for job in start:
            task = asyncio.create_task(self._deliver(job, lease), name=f"job-notify:{job.job_id[:8]}")
            self._tasks[job.job_id] = task
            task.add_done_callback(functools.partial(self._done, job.job_id))
        return len(start)

    async def _read(self) -> tuple[list[JobRecord], set[str], set[str]]:
        """The ended jobs that asked for a notification, from the record copies (never a chunk: ``JobBook.records``),
        and which of them are settled or claimed (two small reads per job not known settled; a settled job stays
        settled, so it is remembered and not read again)."""
        records = [r for r in await self.book.records()
                   if r.terminal and r.notify and r.job_id not in self._settled]
        settled: set[str] = set()
        claimed: set[str] = set()
        for rec in records:
            if await self.store.get(job_notify_key(rec.job_id)) is not None:
                settled.add(rec.job_id)
            elif await self.store.get(job_notify_key(rec.job_id, claim=True)) is not None:
                claimed.add(rec.job_id)
        self._settled |= settled
        if len(self._settled) > MAX_REMEMBERED:  # bounded: forgetting one costs two reads, never a resend
            self._settled.clear()
        return records, settled, claimed

    def _done(self, job_id: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(job_id, None)

    async def _claim_lease(self) -> Lease:
        if self._lease is None or not self._lease.alive:
            self._lease = await self.store.lease(self.cfg.claim_ttl_s)
        return self._lease

    async def _deliver(self, job: JobRecord, lease: Lease) -> None:
        """Claim, send, record. Any failure before the record leaves the job due again next round."""
        notified, notifying = job_notify_key(job.job_id), job_notify_key(job.job_id, claim=True)
        claim = {"schema": 1, "by": self.owner, "token": uuid.uuid4().hex}
        try:
            res = await self.store.txn([CreateRevision(notified, "==", 0), CreateRevision(notifying, "==", 0)],
                                       [Put(notifying, claim, lease=lease)])
            if not res.succeeded:
                return  # another sender has it, or it was recorded since our read
            try:
                outcome = await self._send(job)
                await self._record(job, outcome, notified, notifying, claim)
            finally:
                with contextlib.suppress(StoreError, TimeoutError):  # still ours after all that: give it back
                    await self.store.txn([ValueEquals(notifying, claim)], [Delete(notifying)])
        except asyncio.CancelledError:
            raise
        except Exception:  # a delivery never dies unseen; the job is due again next round
            log.exception("notification of job %s failed", job.job_id,
                          extra=kv(event="job_notify_error", job=job.job_id, tenant=job.tenant))

    async def _record(self, job: JobRecord, outcome: NotifyOutcome, notified: str, notifying: str,
                      claim: dict[str, Any]) -> None:
        backoff = Backoff(0.2, 2.0)
        res = None
        for attempt in range(3):  # etcd may blink: the POST is made, losing its record would resend it
            try:
                res = await self.store.txn([ValueEquals(notifying, claim), CreateRevision(notified, "==", 0)],
                                           [Put(notified, outcome.to_json()), Delete(notifying)])
                break
            except StoreError:
                if attempt == 2:
                    raise
                await asyncio.sleep(backoff.next())
        if res is None or not res.succeeded:  # our claim lapsed (lease lost): whoever claims next sends again
            log.warning("job %s notification %s but its claim lapsed: not recorded", job.job_id, outcome.state,
                        extra=kv(event="job_notify_unrecorded", job=job.job_id, tenant=job.tenant))
            return
        log.info("job %s notification %s after %d attempt(s)%s", job.job_id, outcome.state, outcome.attempts,
                 f": {outcome.error}" if outcome.error else "",
                 extra=kv(event=f"job_notify_{outcome.state}", job=job.job_id, tenant=job.tenant))

    def _allowed(self, job: JobRecord) -> tuple[WebhookUrl, Tenant]:
        """The job's URL if the tenant still allows it now; ``ValueError`` saying why not."""
        tenant = self.tenants().get(job.tenant)
        if tenant is None:
            raise ValueError(f"tenant {job.tenant!r} is not in the topology any more")
        return allowed_target(job.notify, tenant.webhooks, job.tenant), tenant

    def _context(self, tenant: Tenant) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.cafile if tenant.webhook_ca is None else None,
                                         cadata=tenant.webhook_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    async def _send(self, job: JobRecord) -> NotifyOutcome:
        view = await self.book.view(job.job_id)
        if view is None:
            return NotifyOutcome("failed", 0, time.time(), 0, "not sent: the job's record is gone")
        body = json.dumps(payload(view), separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", DELIVERY_HEADER: job.job_id,
                   "User-Agent": "tiermesh-job-notify/1"}
        backoff = Backoff(self.cfg.backoff_base_s, self.cfg.backoff_cap_s)
        status, error = 0, ""
        assert self._session is not None  # running
        for attempt in range(1, self.cfg.attempts + 1):
            try:
                url, tenant = self._allowed(job)  # again before every attempt: the operator may have removed it
                ctx = self._context(tenant)
            except (ValueError, ssl.SSLError, OSError) as exc:
                return NotifyOutcome("failed", attempt - 1, time.time(), status, f"not sent: {exc}"[:2000])
            self.sent += 1
            try:
                async with self._session.post(URL(url.text, encoded=True), data=body, headers=headers, ssl=ctx,
                                              allow_redirects=False,
                                              timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as resp:
                    status = resp.status
                if 200 <= status < 300:
                    return NotifyOutcome("delivered", attempt, time.time(), status)
                error = f"the receiver answered HTTP {status}" + (
                    " (redirects are not followed)" if 300 <= status < 400 else "")
                if not retryable(status):
                    return NotifyOutcome("failed", attempt, time.time(), status, error)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                status, error = 0, f"{type(exc).__name__}: {exc}"[:500]
            if attempt < self.cfg.attempts:
                await asyncio.sleep(backoff.next())
        return NotifyOutcome("failed", self.cfg.attempts, time.time(), status,
                             f"{self.cfg.attempts} attempts failed; the last: {error}"[:2000])
