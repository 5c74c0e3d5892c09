"""The site's leased liveness record ``live/<site>``: load, memory, loaded variants, demand.

Looked at every ``interval_s`` and written only when it says something new
(:func:`core_scheduler.state.heartbeat.why_publish`: loaded variants, queue waits, capacity, demand,
identity at once; counters and small drifts at most every ``policy.usage_interval_s``; an unchanged
record every ``policy.max_interval_s``). The record lives under a lease kept by keep-alives, not by
rewrites: a quiet site stays alive while writing nothing, and a dead one's record vanishes within its
TTL. So an idle mesh of N sites costs etcd N keep-alives per TTL/3 and almost no writes, and every
watcher of a record sees an event only when there is news. When etcd is unreachable the agent keeps
serving (degraded) and keeps trying; once etcd answers again it takes a new lease if the old one ended,
writes at once, and the record says how long it was degraded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

from core_scheduler.state.heartbeat import Heartbeat, PublishPolicy, same_usage, why_publish
from mesh.errors import StoreError
from mesh.etcd.keys import live_key
from mesh.etcd.lease import Lease
from mesh.etcd.store import Store
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["Liveness"]

log = get_logger(__name__)


class Liveness(Service):
    def __init__(self, store: Store, site: str, record: Callable[[], Heartbeat], *,
                 ttl_s: float = 3.0, interval_s: float = 0.5, policy: PublishPolicy | None = None) -> None:
        self.store = store
        self.site = site
        self._record = record
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.policy = policy or PublishPolicy()
        self.last: Heartbeat | None = None    # the record last written (under the current lease)
        self._last_at = 0.0                   # monotonic time of that write
        self.writes = 0                       # records written, and their JSON bytes (for the benchmark)
        self.bytes_written = 0
        self.skipped = 0                      # looks that found nothing worth writing
        self.lease: Lease | None = None
        self.degraded_since: float | None = None
        self.degraded_total_s = 0.0      # ended episodes only; see degraded_seconds()
        self.degraded_episodes = 0
        self.lease_renewals = 0           # leases granted again after one was lost
        self._task: asyncio.Task[None] | None = None

    @property
    def degraded(self) -> bool:
        return self.degraded_since is not None

    async def _start(self) -> None:
        await self._beat()  # first record before anyone routes to us
        self._task = asyncio.create_task(self._loop(), name=f"liveness:{self.site}")

    async def _stop(self) -> None:
        await cancel_and_wait(self._task)
        if self.lease is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self.lease.revoke()
            self.lease = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._beat(force=False)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("heartbeat error", extra=kv(site=self.site))

    async def beat(self) -> None:
        """Write the live record now (something in it changed that peers should not wait a beat for)."""
        await self._beat()

    def degraded_seconds(self, now: float | None = None) -> float:
        """Seconds spent degraded so far, the current episode included."""
        current = 0.0
        if self.degraded_since is not None:
            current = (time.monotonic() if now is None else now) - self.degraded_since
        return self.degraded_total_s + current

    async def _renew_lease(self) -> Lease:
        """Our lease, granting a new one if the old one ended (etcd restarted or we were cut off
        longer than the TTL). The old one is revoked only after the record moved to the new one:
        revoking first would delete ``live/<site>`` and every agent would drop us for a moment."""
        if self.lease is not None and self.lease.alive:
            return self.lease
        self.lease = await self.store.lease(self.ttl_s)
        return self.lease

    def _due(self, record: Heartbeat, now: float) -> bool:
        """Whether ``record`` is worth writing now (see the module docstring)."""
        last, age = self.last, now - self._last_at
        if why_publish(last, record, self.policy) is not None or last is None:
            return True
        if age >= self.policy.max_interval_s:
            return True
        return age >= self.policy.usage_interval_s and not same_usage(last, record)

    async def _beat(self, *, force: bool = True) -> None:
        try:
            old = self.lease if self.lease is not None and not self.lease.alive else None
            lease = await self._renew_lease()
            # A record written right after an outage already tells the whole story of it.
            record = self._record().with_liveness(degraded=self.degraded,
                                                  degraded_total_s=self.degraded_seconds(),
                                                  degraded_episodes=self.degraded_episodes,
                                                  lease_renewals=self.lease_renewals)
            now = time.monotonic()
            # a new lease (or an outage ending) means the record may be gone: always write then
            if not force and old is None and not self.degraded and not self._due(record, now):
                self.skipped += 1
                return
            value = record.to_json()
            async with asyncio.timeout(self.ttl_s):
                await self.store.put(live_key(self.site), value, lease=lease)
            self.last, self._last_at = record, now
            self.writes += 1
            self.bytes_written += len(json.dumps(value, separators=(",", ":")))
            if old is not None:
                self.lease_renewals += 1
                with contextlib.suppress(StoreError, TimeoutError):
                    async with asyncio.timeout(self.ttl_s):
                        await old.revoke()
        except (StoreError, TimeoutError) as exc:
            if self.degraded_since is None:
                self.degraded_since = time.monotonic()
                self.degraded_episodes += 1
                log.warning("etcd unreachable, serving in degraded mode: %s", exc,
                            extra=kv(site=self.site, event="degraded"))
            return
        if self.degraded_since is not None:
            episode = time.monotonic() - self.degraded_since
            self.degraded_total_s += episode
            self.degraded_since = None
            log.info("etcd reachable again after %.1f s degraded", episode,
                     extra=kv(site=self.site, event="recovered"))
