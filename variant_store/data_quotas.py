"""The data area's per-tenant quotas, followed from the topology in etcd.

A tenant's ``quotas.storage_mb`` in the topology (``tenants/<name>``, written by ``tiermesh topology apply``) is
how many MiB of data it may keep in the variant store's data area (:class:`variant_store.data_area.DataArea`);
a tenant without it gets the area's default (``DataArea.quota_bytes``).

:class:`DataQuotaFollower` reads every ``tenants/`` value, then watches that prefix from the revision read (read
again whenever the watch cannot resume), and updates ``DataArea.quotas`` in place: an upload checks the quota in
force when its bytes arrive. A value is untrusted (anyone who may write etcd, a newer writer's schema):
:func:`storage_quota` decodes it and raises :class:`ProtocolError` only; a tenant whose value does not decode keeps
the quota it had (logged), the others follow.

The key's name is spelled here and in ``topology.schema.QUOTA_KEYS`` (this layer may not import that one);
a unit test holds the two together.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from mesh.backoff import Backoff
from mesh.errors import ProtocolError
from mesh.etcd.keys import TENANTS, parse_key
from mesh.etcd.store import Store, Undecodable
from mesh.etcd.watch import KeyRange
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from variant_store.data_area import DataArea

__all__ = ["MIB", "STORAGE_QUOTA_KEY", "DataQuotaFollower", "storage_quota"]

log = get_logger(__name__)

STORAGE_QUOTA_KEY = "storage_mb"
MIB = 1 << 20
_MAX_MB = float(1 << 40)  # 1 EiB: far past any disk, and the bytes still an exact integer


def storage_quota(value: Any) -> int | None:
    """The data quota in bytes of a ``tenants/<name>`` value, ``None`` when it sets none; ``ProtocolError`` for
    anything that is not a tenant record with a number in [0, 2**40] MiB there (the only error this raises)."""
    if isinstance(value, Undecodable):
        raise ProtocolError(f"tenant value is no JSON: {value.reason}")
    try:
        return _storage_quota(value)
    except Exception as exc:  # untrusted data: RecursionError, OverflowError... are as likely as ValueError
        raise ProtocolError(f"bad tenant value: {type(exc).__name__}: {str(exc)[:200]}") from exc


def _storage_quota(value: Any) -> int | None:
    if not isinstance(value, dict):
        raise ValueError(f"an object expected, not a {type(value).__name__}")
    quotas = value.get("quotas", {})
    if not isinstance(quotas, dict):
        raise ValueError("quotas are an object")
    mb = quotas.get(STORAGE_QUOTA_KEY)
    if mb is None:
        return None
    if isinstance(mb, bool) or not isinstance(mb, int | float) or not math.isfinite(mb) or not 0 <= mb <= _MAX_MB:
        raise ValueError(f"{STORAGE_QUOTA_KEY} is a number of MiB in [0, {_MAX_MB:g}], not {str(mb)[:40]!r}")
    return int(mb * MIB)


class DataQuotaFollower(Service):
    """Keeps ``area.quotas`` equal to the tenants' ``storage_mb`` in the topology held by ``store``.
    ``connected``: the last read succeeded and the watch is open; ``applied``: changes adopted since start."""

    def __init__(self, store: Store, area: DataArea) -> None:
        self.store = store
        self.area = area
        self.connected = False
        self.applied = 0
        self._task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        # one read before the caller goes on, so a server started next already enforces the topology's quotas
        revision: int | None = None
        try:
            revision = await self._read()
        except Exception as exc:  # etcd away, a refusal: the follow loop reads again with back-off
            log.warning("reading the tenants' data quotas failed; following them in the background",
                        extra=kv(event="data_quota_follow_retry", reason=str(exc)[:300]))
        self._task = asyncio.create_task(self._follow(revision), name="data-quota-follow")

    async def _stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _read(self) -> int:
        """Adopt every tenant's value; returns the revision they were read at."""
        revision = await self.store.revision()  # first: the watch replays what changes during the read
        held = await self.store.get_prefix(TENANTS)
        self._replace({t: item.value for item in held if (t := _tenant(item.key)) is not None}, revision)
        return revision

    async def _follow(self, revision: int | None) -> None:
        """Watch from the revision read (reading first when there is none); when the watch cannot resume
        (compaction) or anything else fails, read again after a jittered back-off. Never returns."""
        backoff = Backoff(0.25, 5.0)
        while True:
            try:
                if revision is None:
                    revision = await self._read()
                async with self.store.watch_ranges([KeyRange.under(TENANTS)], start_revision=revision + 1) as watch:
                    self.connected = True
                    async for ev in watch:
                        backoff.reset()
                        tenant = _tenant(ev.key)
                        if tenant is not None:
                            self._set(tenant, ev.value if ev.kind == "put" else None, ev.revision)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("following the tenants' data quotas failed; reading them again",
                            extra=kv(event="data_quota_follow_retry", reason=str(exc)[:300]))
            revision = None
            self.connected = False
            await asyncio.sleep(backoff.next())

    def _replace(self, values: dict[str, Any], revision: int) -> None:
        """Every tenant's value as read at ``revision``: tenants gone lose their quota (any set by hand too: the
        topology decides), the rest are set."""
        for tenant in set(self.area.quotas) - set(values):
            self._set(tenant, None, revision)
        for tenant, value in values.items():
            self._set(tenant, value, revision)

    def _set(self, tenant: str, value: Any, revision: int) -> None:
        """Adopt one tenant's value (``None``: deleted); a value that does not decode keeps the quota in force."""
        try:
            quota = None if value is None else storage_quota(value)
        except ProtocolError as exc:
            log.warning("ignoring tenant %r's value at revision %d: %s; its data quota stays %d bytes",
                        tenant[:64], revision, exc, self.area.quota(tenant),
                        extra=kv(event="data_quota_refused", reason=str(exc)[:300]))
            return
        before = self.area.quotas.get(tenant)
        if quota == before:
            return
        if quota is None:
            del self.area.quotas[tenant]
        else:
            self.area.quotas[tenant] = quota
        self.applied += 1
        log.info("tenant %r's data quota: %s bytes", tenant[:64],
                 self.area.quota_bytes if quota is None else quota,
                 extra=kv(tenant=tenant[:64], event="data_quota_set", reason=f"revision={revision}"))


def _tenant(key: str) -> str | None:
    """The tenant a ``tenants/`` key names; ``None`` for any other key under that prefix (not a tenant's)."""
    parsed = parse_key(key)
    return parsed[1][0] if parsed is not None and parsed[0] == "tenant" else None
