"""Leader election on etcd by the standard recipe, over :class:`mesh.etcd.store.Store`.

Each candidate puts a key under ``election/<name>/`` bound to its own lease; the key with the
lowest create revision leads; the others each wait for the deletion of the key just before theirs
(no thundering herd). ``leader_revision`` (our key's create revision) is a fencing token: guard
leader-only writes with ``CreateRevision(<our key>, "==", leader_revision)`` in a txn.

One :class:`Election` may campaign again after it lost or resigned. A lease it could not revoke
(etcd was unreachable) is remembered and revoked before the next campaign: etcd renews every
lease when it restarts, so our old key would otherwise stand in front of us for a whole TTL.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from mesh.errors import StoreError
from mesh.etcd.lease import Lease
from mesh.etcd.ops import CreateRevision, Put
from mesh.etcd.store import Store
from mesh.lifecycle import cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["Election"]

log = get_logger(__name__)


class Election:
    def __init__(self, store: Store, name: str, candidate_id: str, ttl: float = 5.0) -> None:
        self._store = store
        self.name = name
        self.candidate_id = candidate_id
        self.ttl = ttl
        self._prefix = f"election/{name}/"
        self.key: str | None = None
        self.is_leader = False
        self.leader_revision = 0
        self.lost = asyncio.Event()
        self._lease: Lease | None = None
        self._orphans: set[int] = set()  # our lease ids etcd may still hold
        self._monitor: asyncio.Task[None] | None = None

    async def campaign(self) -> None:
        """Block until this candidate leads. Raises ``StoreError`` if our lease is lost meanwhile."""
        if self.is_leader:
            return
        await self._revoke_orphans()
        self.lost.clear()
        lease = self._lease = await self._store.lease(self.ttl)
        key = self.key = f"{self._prefix}{lease.id:016x}"
        try:
            res = await self._store.txn([CreateRevision(key, "==", 0)],
                                        [Put(key, {"candidate": self.candidate_id}, lease=lease)])
            mine = res.revision
            while True:
                kvs, rev = await self._store._range(self._prefix)
                if not any(x.key == key for x in kvs):
                    raise StoreError(f"election key {key} vanished while campaigning (lease lost)")
                older = [x for x in kvs if x.create_revision < mine]
                if not older:
                    break
                pred = max(older, key=lambda x: x.create_revision)
                await self._wait_deleted(pred.key, rev, lease)
            self.is_leader, self.leader_revision = True, mine
            self._monitor = asyncio.get_running_loop().create_task(
                self._watch_self(key, mine, lease), name=f"election-{self.name}")
            log.info("elected leader", extra=kv(event="elected", reason=f"{self.name}:{self.candidate_id}"))
        except BaseException:
            await self._drop_lease()
            raise

    async def _revoke_orphans(self) -> None:
        for lease_id in sorted(self._orphans):
            try:
                await self._store.revoke_lease(lease_id)
            except StoreError:
                continue  # still unreachable: the campaign below fails too and is retried
            self._orphans.discard(lease_id)

    async def _wait_deleted(self, key: str, rev: int, lease: Lease) -> None:
        async def deleted() -> None:
            async with self._store.watch_prefix(key, start_revision=rev + 1) as w:
                async for ev in w:
                    if ev.kind == "delete" and ev.key == key:
                        return

        waiter = asyncio.ensure_future(deleted())
        lost = asyncio.ensure_future(lease.lost.wait())
        try:
            await asyncio.wait({waiter, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (waiter, lost):
                t.cancel()
            await asyncio.gather(waiter, lost, return_exceptions=True)
        if lease.lost.is_set():
            raise StoreError(f"lease lost while campaigning in election {self.name!r}")
        if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
            raise waiter.exception()  # type: ignore[misc]

    async def _watch_self(self, key: str, rev: int, lease: Lease) -> None:
        """Runs while we lead: leadership ends when our key goes or our lease is lost."""
        watcher = asyncio.ensure_future(self._wait_deleted(key, rev, lease))
        try:
            await watcher
        except StoreError as exc:
            log.warning("leadership lost", extra=kv(event="leader_lost", reason=str(exc)))
        else:
            log.warning("leadership lost: election key deleted", extra=kv(event="leader_lost"))
        self.is_leader = False
        self.lost.set()

    async def _drop_lease(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            async with asyncio.timeout(self._store.timeout):
                await lease.revoke()
        except (StoreError, TimeoutError):
            self._orphans.add(lease.id)

    async def resign(self) -> None:
        """Give up leadership (or candidacy) now; the next candidate takes over at once."""
        task, self._monitor = self._monitor, None
        await cancel_and_wait(task)
        self.is_leader = False
        await self._drop_lease()

    async def leader(self) -> str | None:
        """The current leader's candidate id, or None if nobody campaigns."""
        kvs = await self._store.get_prefix(self._prefix)
        if not kvs:
            return None
        first = min(kvs, key=lambda x: x.create_revision)
        return str(first.value.get("candidate")) if isinstance(first.value, dict) else str(first.value)

    async def __aenter__(self) -> Election:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.resign()
