"""Which variants each site may fetch from the variant store: those placement asks of it, from etcd
``placement/<site>`` (written by the scheduler leader only: etcd RBAC; a site cannot write its own), and for
:data:`GRACE_S` after placement stops asking.

The rule (:mod:`variant_store.access`): a site serves tenant T, and may read T's private variants, while placement
asks it for one of T's variants. It is read from the one record a compromised site cannot forge, and it is
auditable (``placement/<site>`` and its events say who may read what). Not chosen: "T's queries could be routed
there" (nearly every site with the hardware: as wide as before), and a site's own heartbeat (it writes that itself).

Timing, both ways:

- placement just *added* a variant at S: S sees it through its view and fetches at once; the store reads
  ``placement/<S>`` from etcd at that request (a linearizable get, never a cached copy), so S's fetch can never
  arrive before the store knows. No race.
- placement just *removed* it (moved elsewhere, or S's load failed and the next round placed it anew): S may be in
  the middle of the fetch (a large blob, resumed with ``Range``), or routing may still send S a cold start of T's
  task. For :data:`GRACE_S` after the removal the site keeps its right: the follower watches ``placement/`` and
  remembers when each variant left each site. A store that restarts forgets that history: a site whose variant was
  removed just before it keeps no grace (its fetch is refused and its query retried elsewhere).

Placement asks for variants; the rule grants tenants: a site placed with one of T's variants may also fetch T's
others (a cold start of a sibling variant of T's task, which routing picks per query), never another tenant's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from mesh.backoff import Backoff
from mesh.etcd.keys import PLACEMENT, last_segment, placement_key
from mesh.etcd.store import Store
from mesh.etcd.watch import KeyRange
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["GRACE_S", "Pair", "PlacedVariants", "placed_pairs"]

log = get_logger(__name__)
GRACE_S = 300.0  # a removed variant stays readable this long: a 90 MB fetch on a slow link, resumed, fits
Pair = tuple[str, str]  # (task, variant id)


def placed_pairs(value: Any) -> frozenset[Pair]:
    """The (task, variant id) pairs a ``placement/<site>`` value asks for; nothing for anything malformed (the
    value is the scheduler's, but a bad one must grant nothing rather than fail the request)."""
    variants = value.get("variants") if isinstance(value, dict) else None
    if not isinstance(variants, list):
        return frozenset()
    return frozenset((v["task"], v["variant_id"]) for v in variants
                     if isinstance(v, dict) and isinstance(v.get("task"), str) and isinstance(v.get("variant_id"), str))


class PlacedVariants(Service):
    """What placement asks of each site now (read from etcd at each question) and asked until recently (followed
    through a watch on ``placement/``)."""

    def __init__(self, store: Store, *, grace_s: float = GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.grace_s, self._clock = store, grace_s, clock
        self._placed: dict[str, frozenset[Pair]] = {}
        self._gone: dict[str, dict[Pair, float]] = {}  # site -> pair -> when placement stopped asking for it
        self._task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="placed-variants")

    async def _stop(self) -> None:
        await cancel_and_wait(self._task)

    async def placed(self, site: str) -> frozenset[Pair]:
        """The variants ``site`` may fetch now: what ``placement/<site>`` asks (read from etcd now) and what it
        asked until less than ``grace_s`` ago."""
        held = await self.store.get(placement_key(site))
        now = self._clock()
        recent = {p for p, left in self._gone.get(site, {}).items() if now - left <= self.grace_s}
        # what the watch holds too: a removal it has not delivered yet has not started its grace
        return placed_pairs(held.value if held is not None else None) | self._placed.get(site, frozenset()) | recent

    def record(self, site: str, pairs: frozenset[Pair]) -> None:
        """Placement of ``site`` is now ``pairs``: what it no longer asks for starts its grace."""
        now = self._clock()
        before = self._placed.get(site, frozenset())
        gone = self._gone.setdefault(site, {})
        for pair in before - pairs:
            gone[pair] = now
        for pair in pairs:
            gone.pop(pair, None)
        for pair, left in list(gone.items()):  # bounded: only what left within the grace is kept
            if now - left > self.grace_s:
                del gone[pair]
        self._placed[site] = pairs

    async def _follow(self) -> None:
        """Read every placement, then watch from that revision; on any failure read again after a back-off (a
        variant removed while the watch was down starts its grace at the re-read). Never returns."""
        backoff = Backoff(0.25, 5.0)
        while True:
            try:
                revision = await self.store.revision()
                current = {last_segment(kv.key): placed_pairs(kv.value)
                           for kv in await self.store.get_prefix(PLACEMENT)}
                for site in set(self._placed) | set(current):
                    self.record(site, current.get(site, frozenset()))
                async with self.store.watch_ranges([KeyRange.under(PLACEMENT)], start_revision=revision + 1) as w:
                    async for ev in w:
                        backoff.reset()
                        self.record(last_segment(ev.key), placed_pairs(ev.value if ev.kind == "put" else None))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("following %s failed; reading it again", PLACEMENT,
                            extra=kv(event="placed_follow_retry", reason=str(exc)[:300]))
            await asyncio.sleep(backoff.next())
