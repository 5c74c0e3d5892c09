"""An agent's cached view of global state, kept current by one etcd watch.

Per-query routing must not touch etcd: the agent reads what it follows once, then follows a watch
from the revision it read (resuming after etcd restarts is the Store's job). Each change marks the
view dirty; ``on_change`` listeners rebuild derived state (the routing table) at most every
``debounce_s``. When etcd is unreachable the last view stays in force (degraded mode).

``scope``: what an agent routes on (:mod:`core_scheduler.state.scope`): the shared configuration, its
own placement and the heartbeats of its route set, as a few key ranges on one watch stream. A topology
change that changes the route set re-reads the view with the new ranges. ``None`` (the scheduler):
the whole prefix. What changed is kept per kind (``revisions``) and per heartbeat (``live_revision``),
so a snapshot builder redoes only what changed; ``generation`` counts full re-reads.

``crl`` is the revocation list PEM published at ``pki/crl`` (unverified: the agent hands it to its trust
stores, which check the CA signature and adopt only a newer list); ``site_certs`` the site certificates published
at ``pki/sites/<site>`` (PEM, unverified: the agent's CURVE trust believes one only if the CA signed it for that
site and has not revoked it).

Values a reader cannot trust (a site writes its own ``live/<site>`` and ``pki/sites/<site>``, so a compromised one
anything) pass one decoder, :func:`core_scheduler.state.records.decode_record`, into :class:`ViewState`. A value
that does not decode changes nothing: the key keeps its last good record, the view counts it (``refused``, and
``rejected``: key -> why) and says so at most every ``COMPLAIN_EVERY_S`` per key; so does a variant entry whose id
another task catalogued first (:mod:`core_scheduler.state.view_state`). A full read builds a new state
aside and swaps it in whole, so a read that fails leaves the last good view in force. The follow and notify loops
run under :func:`core_scheduler.state.supervise.supervise`: an unexpected error is logged and the loop runs again
after a jittered back-off; a follow that starts again reads the view afresh first (events of several ranges are not
ordered across ranges, so a watch is never resumed past an error).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from core_scheduler.state.heartbeat import Heartbeat
from core_scheduler.state.scope import Scope, view_ranges
from core_scheduler.state.supervise import supervise
from core_scheduler.state.view_state import ViewKind, ViewState
from mesh.errors import ProtocolError
from mesh.etcd.ops import KV
from mesh.etcd.store import Store
from mesh.etcd.watch import KeyRange
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from mesh.types import TaskSignature
from topology.schema import Link, Site, Tenant, Topology
from variant_store.cascade_meta import CascadeMeta
from variant_store.meta import VariantMeta
from variant_store.pipeline_meta import PipelineMeta

__all__ = ["COMPLAIN_EVERY_S", "MeshView"]

log = get_logger(__name__)
COMPLAIN_EVERY_S = 10.0  # a key whose values keep being refused is reported at most this often


class MeshView(Service):
    def __init__(self, store: Store, site: str, *, debounce_s: float = 0.05, scope: Scope | None = None) -> None:
        self.store = store
        self.site = site
        self.debounce_s = debounce_s
        self.scope = scope
        self.ranges: tuple[KeyRange, ...] = (KeyRange.under(""),)
        self.revision = 0
        self.generation = 0                    # full (re-)reads so far
        self.events = 0                        # watch events received, and their bytes
        self.event_bytes = 0
        self.load_bytes = 0                    # bytes read by full reads
        self.refused = 0                       # values refused (their keys kept their last good records)
        self.resyncs = 0                       # full re-reads after the first (a failed follow, a new route set)
        self._held = ViewState()  # not _state: Service keeps its lifecycle there
        self._scope_dirty = False
        self._stale = False                    # the next run of the follow reads the view afresh first
        self._complaints: dict[str, tuple[float, int]] = {}  # key -> (last reported, refusals not reported)
        self._listeners: list[Callable[[], None]] = []
        # what the last notification covered: the kinds of keys changed since the one before ("all" after a full
        # read); listeners read it to tell a load report from a change of what the mesh is (edge_agent.table_pacer)
        self.changes: frozenset[str] = frozenset({"all"})
        self._changes: set[str] = set()
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._follow_task: asyncio.Task[None] | None = None
        self.connected = False
        self.loaded = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------
    async def _start(self) -> None:
        await self._load_all()
        self._follow_task = self._spawn_follow()
        self._tasks = [asyncio.create_task(supervise("view notify loop", self._notify_loop, site=self.site),
                                           name=f"view-notify:{self.site}")]

    async def _stop(self) -> None:
        await cancel_and_wait(self._follow_task, *self._tasks)
        self._tasks, self._follow_task = [], None

    def _spawn_follow(self) -> asyncio.Task[None]:
        return asyncio.create_task(supervise("view follow", self._follow, site=self.site),
                                   name=f"view-watch:{self.site}")

    def on_change(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    # -- what it holds (the state in force: a full read replaces it whole) -----------------
    @property
    def sites(self) -> dict[str, Site]:
        return self._held.sites

    @property
    def links(self) -> dict[tuple[str, str], Link]:
        return self._held.links

    @property
    def tenants(self) -> dict[str, Tenant]:
        return self._held.tenants

    @property
    def variants(self) -> dict[str, dict[str, VariantMeta]]:
        return self._held.variants

    @property
    def cascades(self) -> dict[str, dict[str, CascadeMeta]]:
        """task -> cascade id -> its calibrated entry (``cascades/<task>/<id>``, issue 33), as etcd holds it: a
        stage may have been removed since (the snapshot builder keeps only cascades whose stages it serves)."""
        return self._held.cascades

    @property
    def pipelines(self) -> dict[str, PipelineMeta]:
        """task -> its graph of other tasks (``pipelines/<task>``, issue 33), as etcd holds it: a stage task may have
        gone since (the door fails such a stage's query, naming it)."""
        return self._held.pipelines

    @property
    def signatures(self) -> dict[str, TaskSignature]:
        return self._held.signatures

    @property
    def live(self) -> dict[str, Heartbeat]:
        return self._held.live

    @property
    def placement(self) -> dict[str, dict[str, Any]]:
        return self._held.placement

    @property
    def services(self) -> dict[str, dict[str, Any]]:
        return self._held.services

    @property
    def crl(self) -> bytes | None:
        return self._held.crl

    @property
    def site_certs(self) -> dict[str, bytes]:
        return self._held.site_certs

    @property
    def revisions(self) -> dict[str, int]:
        """kind -> revision of its last change (a snapshot builder redoes only what changed)"""
        return self._held.revisions

    @property
    def live_revision(self) -> dict[str, int]:
        """site -> revision of the heartbeat held"""
        return self._held.live_revision

    @property
    def rejected(self) -> dict[str, str]:
        """key -> why its value was refused (the key holds its last good record, or none)"""
        return self._held.rejected

    @property
    def topology(self) -> Topology | None:
        return self._held.topology

    def variant(self, task: str, variant_id: str) -> VariantMeta | None:
        return self.variants.get(task, {}).get(variant_id)

    def alive_sites(self) -> set[str]:
        return set(self.live)

    # -- state updates ---------------------------------------------------------------------
    async def _read(self, ranges: tuple[KeyRange, ...]) -> list[KV]:
        if ranges == (KeyRange.under(""),):
            return await self.store.get_prefix("")
        parts = await asyncio.gather(*(self.store.get_range(r) for r in ranges))
        return [kv_ for part in parts for kv_ in part]

    async def _load_all(self) -> None:
        """Read what the view follows at one revision into a new state and swap it in whole. A reload after a
        gap (compaction) must also forget keys deleted meanwhile, so the state is rebuilt, not merged; a key whose
        value is refused keeps the record the state in force holds."""
        # revision first: the watch then replays anything that changed during the read, in order
        rev = await self.store.revision()
        state = ViewState()
        ranges: tuple[KeyRange, ...]
        if self.scope is None:
            ranges = (KeyRange.under(""),)
            self._fill(state, await self._read(ranges))
        else:
            # the route set comes from the topology: read the configuration first, then the heartbeats
            shared = view_ranges(None, self.scope)[:-1]
            self._fill(state, await self._read(shared))
            ranges = view_ranges(state.topology, self.scope)
            self._fill(state, await self._read(ranges[len(shared):]))
        # no await from here on: listeners never see a half view, and a failed read above changed nothing
        self._held, self.ranges, self.revision = state, ranges, rev
        self.generation += 1
        self._scope_dirty = False
        self.connected = True
        self.loaded.set()
        self._changes.add("all")
        self._dirty.set()

    def _fill(self, state: ViewState, items: list[KV]) -> None:
        for item in items:
            self.load_bytes += len(item.key)
            self._noted(item.key, state.put(item.key, item.value, item.mod_revision, before=self._held,
                                            created=item.create_revision))
            self._note_displaced(state)

    async def _follow(self) -> None:
        """One run of the watch, from the view's revision until it fails (its supervisor runs it again). A run
        after a failure or a new route set reads the view afresh first; the last good view stays in force until
        that read succeeds."""
        if self._stale:
            self.resyncs += 1
            await self._load_all()
        self._stale = True  # whatever ends this watch (a compaction, an error), the next run starts from a read
        watch = self.store.watch_ranges(self.ranges, start_revision=self.revision + 1)
        try:
            async for ev in watch:
                self.connected = True
                self.events += 1
                self.event_bytes += ev.size
                held = self._held  # a put of JSON null is a value (refused), not a delete
                self._noted(ev.key, held.put(ev.key, ev.value, ev.revision) if ev.kind == "put"
                            else held.delete(ev.key, ev.revision))
                self._note_displaced(held)
                self.revision = max(self.revision, ev.revision)
                self._dirty.set()
        finally:
            self.connected = False
            await watch.close()

    async def _rescope(self) -> None:
        """The topology changed: when the route set did too, follow the new ranges (read afresh)."""
        self._scope_dirty = False
        if self.scope is None or view_ranges(self.topology, self.scope) == self.ranges:
            return
        log.info("route set changed: following %d key ranges", len(view_ranges(self.topology, self.scope)),
                 extra=kv(site=self.site, event="rescope"))
        await cancel_and_wait(self._follow_task)
        self._stale = True
        self._follow_task = self._spawn_follow()

    async def _notify_loop(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.debounce_s)
            self._dirty.clear()
            self.changes, self._changes = frozenset(self._changes), set()
            if self._scope_dirty:
                try:
                    await self._rescope()
                except Exception:
                    log.exception("rescoping the view failed", extra=kv(site=self.site))
            for fn in self._listeners:
                try:
                    fn()
                except Exception:
                    log.exception("view listener failed", extra=kv(site=self.site))

    def _apply(self, key: str, value: Any | None, revision: int = 0) -> None:
        """One key's new value (``None``: deleted) into the state in force."""
        held = self._held
        self._noted(key, held.delete(key, revision) if value is None else held.put(key, value, revision))
        self._note_displaced(held)

    def _note_displaced(self, state: ViewState) -> None:
        """Variant entries a put just pushed aside (an id claimed earlier arrived after them): reported as refused."""
        for key, exc in state.take_displaced():
            self._refused(key, exc)

    def _noted(self, key: str, outcome: ViewKind | ProtocolError | None) -> None:
        if isinstance(outcome, ProtocolError):
            self._refused(key, outcome)
        elif outcome is not None:
            self._changes.add(outcome)
            self._complaints.pop(key, None)
            if outcome in ("site", "link"):
                self._scope_dirty = True

    def _refused(self, key: str, exc: ProtocolError) -> None:
        """Say a value was refused: a key's first at once, then at most every ``COMPLAIN_EVERY_S`` with how many
        were held back (a site rewriting its key in a loop must not flood the log)."""
        self.refused += 1
        now = time.monotonic()
        last, held = self._complaints.get(key, (-math.inf, 0))
        if now - last < COMPLAIN_EVERY_S:
            self._complaints[key] = (last, held + 1)
            return
        self._complaints[key] = (now, 0)
        log.warning("ignoring a bad value at %r (its last good one stays): %s%s", key, exc.message[:300],
                    f" ({held} more since the last report)" if held else "",
                    extra=kv(site=self.site, event="bad_value"))
