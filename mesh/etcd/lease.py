"""An etcd lease and the keep-alive task that owns it, over :class:`mesh.etcd.store.Store`.

Granted by ``await store.lease(ttl)``. Like every module but :mod:`mesh.etcd.store` this one does not
touch the etcd client: the store makes each keep-alive round trip and translates its errors.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from mesh.errors import StoreError
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["Lease", "LeaseOwner"]

log = get_logger("mesh.etcd")


class LeaseOwner(Protocol):
    """What a lease needs of the store that granted it (:class:`mesh.etcd.store.Store`); a
    protocol, so this module does not import the store that imports it."""

    _leases: set[Lease]

    async def _keepalive_once(self, lease_id: int, timeout: float) -> int: ...  # noqa: ASYNC109

    async def revoke_lease(self, lease_id: int) -> bool: ...


class Lease(Service):
    """A granted lease whose keep-alive task this object owns. ``lost`` is set (and ``alive`` is
    False) once etcd says it expired, it was revoked, or keep-alives failed for longer than the TTL."""

    def __init__(self, store: LeaseOwner, lease_id: int, ttl: float) -> None:
        self._store = store
        self.id = lease_id
        self.ttl = ttl
        self.lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return not self.lost.is_set()

    async def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keepalive(), name=f"lease-{self.id:x}")

    async def _keepalive(self) -> None:
        last_ok = time.monotonic()
        interval = max(self.ttl / 3.0, 0.2)
        delay = interval
        while True:
            await asyncio.sleep(delay)
            sent = time.monotonic()
            try:
                ttl = await self._store._keepalive_once(self.id, timeout=interval)
            except (StoreError, TimeoutError) as exc:
                if time.monotonic() - last_ok > self.ttl:
                    log.warning("lease lost: keep-alive failing past its TTL",
                                extra=kv(event="lease_lost", reason=f"{self.id:x}: {exc}"))
                    self.lost.set()
                    return
                delay = min(interval, 0.25)  # etcd may be restarting: retry soon
                continue
            if ttl <= 0:
                log.warning("lease lost: expired or revoked in etcd", extra=kv(event="lease_lost"))
                self.lost.set()
                return
            last_ok, delay = sent, interval

    async def revoke(self) -> None:
        """Revoke it in etcd now (its keys vanish); the same as ``stop()`` and leaving ``async with``."""
        await self.stop()

    async def _stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self.lost.set()
        self._store._leases.discard(self)
        await self._store.revoke_lease(self.id)

    def __repr__(self) -> str:
        return f"Lease({self.id:x}, ttl={self.ttl:g}, alive={self.alive})"
