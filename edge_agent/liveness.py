"""The site's leased liveness record ``live/<site>``: load, memory, loaded variants, demand.

Refreshed every ``interval_s``. When etcd is unreachable the agent keeps serving (degraded) and
keeps trying; once etcd answers again it takes a new lease if the old one ended, and the record
says how long it was degraded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from core_scheduler.state.heartbeat import Heartbeat
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
                 ttl_s: float = 3.0, interval_s: float = 0.5) -> None:
        self.store = store
        self.site = site
        self._record = record
        self.ttl_s = ttl_s
        self.interval_s = interval_s
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
                await asyncio.wait_for(self.lease.revoke(), 2.0)
            self.lease = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._beat()
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

    async def _beat(self) -> None:
        try:
            old = self.lease if self.lease is not None and not self.lease.alive else None
            lease = await self._renew_lease()
            # A record written right after an outage already tells the whole story of it.
            record = self._record().with_liveness(degraded=self.degraded,
                                                  degraded_total_s=self.degraded_seconds(),
                                                  degraded_episodes=self.degraded_episodes,
                                                  lease_renewals=self.lease_renewals)
            await asyncio.wait_for(self.store.put(live_key(self.site), record.to_json(), lease=lease), self.ttl_s)
            if old is not None:
                self.lease_renewals += 1
                with contextlib.suppress(StoreError, TimeoutError):
                    await asyncio.wait_for(old.revoke(), self.ttl_s)
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
