"""Keeping the revocation list fresh where the CA is held: re-sign it before its nextUpdate and publish it.

A verifier refuses every certificate while the list it holds is past its nextUpdate (:mod:`mesh.pki.crl`: fail
closed), so whoever holds the CA key re-signs the list (same revocations, number + 1) every
:data:`~mesh.pki.policy.CRL_REFRESH` and publishes it at etcd ``pki/crl``, where agents, the variant store and etcd's
CRL follower adopt it (a higher number). ``tiermesh up`` holds its CA and runs a :class:`CrlRefresher`;
``tiermesh pki refresh-crl`` does one refresh (or ``--every``) for an operator.

The refresher looks at the list's age (its lastUpdate), not at a timer of its own: a list re-signed by someone else
meanwhile (``tiermesh pki revoke``) counts, and a mesh started on an old home re-signs at once. A refresh that fails
(etcd down) is tried again every :data:`RETRY_S` with the list still in force: it has CRL_LIFETIME - CRL_REFRESH
(42 h) left when the first try is due.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from mesh.backoff import Backoff
from mesh.errors import MeshError
from mesh.etcd.store import Store
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from mesh.pki.crl import RevocationList
from mesh.pki.local import LocalPki
from mesh.pki.policy import CRL_REFRESH
from tiermesh.pki_etcd import refresh_crl

__all__ = ["RETRY_S", "CrlRefresher", "next_refresh"]

log = get_logger(__name__)
RETRY_S = 30.0


def next_refresh(crl: RevocationList, every: timedelta) -> datetime:
    """When ``crl`` is due to be re-signed: ``every`` after it was signed."""
    return crl.crl.last_update_utc + every


class CrlRefresher(Service):
    """Re-signs ``pki``'s list every ``every`` (and at start, if it is older than that) and publishes it through
    ``store`` (None: writes ``crl.pem`` only). ``refreshed`` counts the lists it signed."""

    def __init__(self, pki: LocalPki, store: Store | None, *, every: timedelta = CRL_REFRESH,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        if every <= timedelta(0):
            raise ValueError(f"a refresh period must be positive, not {every}")
        self.pki, self.store, self.every, self._now = pki, store, every, now
        self.refreshed = 0
        self._task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="crl-refresh")

    async def _stop(self) -> None:
        await cancel_and_wait(self._task)

    async def refresh(self) -> RevocationList:
        """Re-sign and publish now; the list in force after it."""
        if self.store is None:
            crl = await asyncio.to_thread(self.pki.refresh_crl)
        else:
            done = await refresh_crl(self.pki, self.store)
            crl = done.crl
            if not done.published:  # someone published a higher number meanwhile: adopted on the next round
                log.info("etcd holds a newer revocation list (%d) than the one re-signed (%d)", done.held_number,
                         crl.number, extra=kv(event="crl_refresh_superseded"))
        self.refreshed += 1
        log.info("revocation list re-signed: number %d, fresh until %s", crl.number, crl.next_update,
                 extra=kv(event="crl_refreshed"))
        return crl

    async def _loop(self) -> None:
        retry = Backoff(RETRY_S, RETRY_S)  # a steady retry, jittered: replicas that failed together spread out
        while True:
            try:
                crl = await asyncio.to_thread(self.pki.crl)
                wait = (next_refresh(crl, self.every) - self._now()).total_seconds()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue  # look again: someone may have re-signed it meanwhile
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except (MeshError, OSError) as exc:
                log.warning("re-signing the revocation list failed; trying again within %.0f s: %s", RETRY_S, exc,
                            extra=kv(event="crl_refresh_failed", reason=str(exc)[:300]))
                await asyncio.sleep(retry.next())
            except Exception:
                log.exception("re-signing the revocation list failed", extra=kv(event="crl_refresh_failed"))
                await asyncio.sleep(retry.next())
