"""Renewing a running mesh's certificates where the CA is held: ``tiermesh up`` keeps a certificate across starts
while it has more than :data:`~mesh.pki.policy.KEEP_FRACTION` of its lifetime left, so a mesh left serving would
reach the end of one (an operator's 8 h) sooner than a fresh start's. :class:`CertRenewer` runs the home's renewal
every :data:`RENEW_EVERY_S`: each certificate past that fraction is re-issued in place, and the processes using it
reload the files as after a rotation (agents, the SDK, the console and etcd re-read them; a site's new CURVE key is
published before it is taken). A renewal that fails is logged and tried again at the next round."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["RENEW_EVERY_S", "CertRenewer"]

log = get_logger(__name__)
RENEW_EVERY_S = 600.0  # the shortest lifetime kept is half of 8 h: renewed hours before it ends


class CertRenewer(Service):
    """Calls ``renew`` (blocking: file writes; run in a thread) every ``every_s``. ``rounds`` counts the calls
    that returned."""

    def __init__(self, renew: Callable[[], object], *, every_s: float = RENEW_EVERY_S) -> None:
        if every_s <= 0:
            raise ValueError(f"a renewal period must be positive, not {every_s}")
        self._renew, self.every_s = renew, every_s
        self.rounds = 0
        self._task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="cert-renew")

    async def _stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await asyncio.to_thread(self._renew)
                self.rounds += 1
            except Exception as exc:  # a full disk, a CA gone: the certificates in force stay; tried again
                log.warning("renewing the mesh's certificates failed: %s", exc,
                            extra=kv(event="cert_renew_failed", reason=str(exc)[:300]))
