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
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from core_scheduler.state.heartbeat import Heartbeat
from core_scheduler.state.scope import Scope, view_ranges
from mesh.errors import StoreError
from mesh.etcd.keys import parse_key
from mesh.etcd.ops import KV
from mesh.etcd.store import Store
from mesh.etcd.watch import KeyRange
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from mesh.pki.published import cert_pem_from_record
from mesh.types import TaskSignature
from topology.schema import Link, Site, Tenant, Topology
from variant_store.catalog import signature_from_json
from variant_store.meta import VariantMeta

__all__ = ["MeshView"]

log = get_logger(__name__)


class MeshView(Service):
    def __init__(self, store: Store, site: str, *, debounce_s: float = 0.05, scope: Scope | None = None) -> None:
        self.store = store
        self.site = site
        self.debounce_s = debounce_s
        self.scope = scope
        self.ranges: tuple[KeyRange, ...] = (KeyRange.under(""),)
        self.revision = 0
        self.generation = 0                    # full (re-)reads so far
        self.revisions: dict[str, int] = {}    # kind -> revision of its last change
        self.live_revision: dict[str, int] = {}  # site -> revision of the heartbeat held
        self.events = 0                        # watch events received, and their bytes
        self.event_bytes = 0
        self.load_bytes = 0                    # bytes read by full reads
        self._scope_dirty = False
        self.sites: dict[str, dict[str, Any]] = {}
        self.links: dict[tuple[str, str], dict[str, Any]] = {}
        self.tenants: dict[str, dict[str, Any]] = {}
        self.variants: dict[str, dict[str, VariantMeta]] = {}
        self.signatures: dict[str, TaskSignature] = {}
        self.live: dict[str, Heartbeat] = {}
        self.placement: dict[str, dict[str, Any]] = {}
        self.services: dict[str, Any] = {}
        self.crl: bytes | None = None
        self.site_certs: dict[str, bytes] = {}
        self._topology: Topology | None = None
        self._listeners: list[Callable[[], None]] = []
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._follow_task: asyncio.Task[None] | None = None
        self.connected = False
        self.resyncs = 0  # full re-reads after the watch could not resume
        self.loaded = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------
    async def _start(self) -> None:
        await self._load_all()
        self._follow_task = asyncio.create_task(self._follow(), name=f"view-watch:{self.site}")
        self._tasks = [asyncio.create_task(self._notify_loop(), name=f"view-notify:{self.site}")]

    async def _stop(self) -> None:
        await cancel_and_wait(self._follow_task, *self._tasks)
        self._tasks, self._follow_task = [], None

    def on_change(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    # -- derived ---------------------------------------------------------------------------
    @property
    def topology(self) -> Topology | None:
        if self._topology is None and self.sites:
            self._topology = Topology(
                sites={n: Site.from_dict(d) for n, d in self.sites.items()},
                links=tuple(Link.from_dict(d) for d in self.links.values()),
                tenants={n: Tenant.from_dict(d) for n, d in self.tenants.items()})
        return self._topology

    def variant(self, task: str, variant_id: str) -> VariantMeta | None:
        return self.variants.get(task, {}).get(variant_id)

    def alive_sites(self) -> set[str]:
        return set(self.live)

    # -- state updates ---------------------------------------------------------------------
    def _reset(self) -> None:
        self.sites, self.links, self.tenants = {}, {}, {}
        self.variants, self.signatures = {}, {}
        self.live, self.placement, self.services = {}, {}, {}
        self.crl = None
        self.site_certs = {}
        self._topology = None
        self.revisions, self.live_revision = {}, {}

    async def _read(self, ranges: tuple[KeyRange, ...]) -> list[KV]:
        if ranges == (KeyRange.under(""),):
            return await self.store.get_prefix("")
        parts = await asyncio.gather(*(self.store.get_range(r) for r in ranges))
        return [kv_ for part in parts for kv_ in part]

    async def _load_all(self) -> None:
        """Read what the view follows at one revision and replace the view with it. A reload after a gap
        (compaction) must also forget keys deleted meanwhile, so the state is rebuilt, not merged."""
        # revision first: the watch then replays anything that changed during the read, in order
        rev = await self.store.revision()
        ranges: tuple[KeyRange, ...]
        if self.scope is None:
            ranges = (KeyRange.under(""),)
            items = await self._read(ranges)
        else:
            # the route set comes from the topology: read the configuration first, then the heartbeats
            shared = view_ranges(None, self.scope)[:-1]
            items = await self._read(shared)
            ranges = view_ranges(_topology_of(items), self.scope)
            items += await self._read(ranges[len(shared):])
        self._reset()  # no await between reset and apply: listeners never see a half view
        self.ranges = ranges
        for item in items:
            self.load_bytes += len(item.key)
            self._apply(item.key, item.value, item.mod_revision)
        self.revision = rev
        self.generation += 1
        self._scope_dirty = False
        self.connected = True
        self.loaded.set()
        self._dirty.set()

    async def _follow(self, reload: bool = False) -> None:
        backoff = 0.25
        while True:
            if reload:
                await self._resync(backoff if self.resyncs else 0.0)
                reload = False
            try:
                watch = self.store.watch_ranges(self.ranges, start_revision=self.revision + 1)
                try:
                    async for ev in watch:
                        self.connected = True
                        backoff = 0.25
                        self.events += 1
                        self.event_bytes += ev.size
                        self._apply(ev.key, ev.value if ev.kind == "put" else None, ev.revision)
                        self.revision = max(self.revision, ev.revision)
                        self._dirty.set()
                finally:
                    await watch.close()
            except asyncio.CancelledError:
                raise
            except StoreError as exc:
                # The Store's watch resumes by itself across etcd restarts; it only gives up when
                # etcd compacted past our revision. Then the view is read again from scratch.
                self.connected = False
                self.resyncs += 1
                log.warning("watch cannot resume, re-reading the view: %s", exc, extra=kv(site=self.site))
                reload = True
                backoff = min(backoff * 2, 5.0)
            except Exception:
                # events of several ranges are not ordered across ranges: read again rather than guess
                self.connected = False
                self.resyncs += 1
                log.exception("view follow error", extra=kv(site=self.site))
                reload = True
                backoff = min(backoff * 2, 5.0)

    async def _resync(self, backoff: float) -> None:
        """Reload until it works (the last view stays in force meanwhile)."""
        while True:
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
            try:
                await self._load_all()
                return
            except StoreError as exc:
                log.warning("view reload failed: %s", exc, extra=kv(site=self.site))
                backoff = min(max(backoff, 0.25) * 2, 5.0)

    async def _rescope(self) -> None:
        """The topology changed: when the route set did too, follow the new ranges (read afresh)."""
        self._scope_dirty = False
        if self.scope is None or view_ranges(self.topology, self.scope) == self.ranges:
            return
        log.info("route set changed: following %d key ranges", len(view_ranges(self.topology, self.scope)),
                 extra=kv(site=self.site, event="rescope"))
        await cancel_and_wait(self._follow_task)
        self._follow_task = asyncio.create_task(self._follow(reload=True), name=f"view-watch:{self.site}")

    async def _notify_loop(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.debounce_s)
            self._dirty.clear()
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
        parsed = parse_key(key)
        if parsed is None:
            return
        kind, names = parsed
        self.revisions[kind] = max(self.revisions.get(kind, 0), revision)
        try:
            if kind == "site":
                self._topology = None
                self._scope_dirty = True
                _set(self.sites, names[0], value)
            elif kind == "link":
                self._topology = None
                self._scope_dirty = True
                _set(self.links, (names[0], names[1]), value)
            elif kind == "tenant":
                self._topology = None
                _set(self.tenants, names[0], value)
            elif kind == "task":
                _set(self.signatures, names[0], None if value is None else signature_from_json(value))
            elif kind == "variant":
                bucket = self.variants.setdefault(names[0], {})
                _set(bucket, names[1], None if value is None else VariantMeta.from_json(value))
            elif kind == "live":
                self.live_revision.pop(names[0], None)
                _set(self.live, names[0], None if value is None else Heartbeat.from_json(value, site=names[0]))
                if value is not None:
                    self.live_revision[names[0]] = revision
            elif kind == "placement":
                _set(self.placement, names[0], value)
            elif kind == "service":
                _set(self.services, names[0], value)
            elif kind == "crl":
                from mesh.pki.crl import crl_pem_from_record  # cryptography: only once a mesh publishes one

                self.crl = None if value is None else crl_pem_from_record(value)
            elif kind == "site_cert":
                _set(self.site_certs, names[0], None if value is None else cert_pem_from_record(value))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring malformed value at %s: %s", key, exc, extra=kv(site=self.site))


def _topology_of(items: list[KV]) -> Topology | None:
    """The sites and links among ``items`` (for the route set; tenants do not matter to paths)."""
    sites: dict[str, Site] = {}
    links: list[Link] = []
    for item in items:
        parsed = parse_key(item.key)
        try:
            if parsed is not None and parsed[0] == "site":
                sites[parsed[1][0]] = Site.from_dict(item.value)
            elif parsed is not None and parsed[0] == "link":
                links.append(Link.from_dict(item.value))
        except (KeyError, TypeError, ValueError):
            continue  # _apply says so when it meets it
    if not sites:
        return None
    return Topology(sites=sites, links=tuple(lk for lk in links if lk.a in sites and lk.b in sites), tenants={})


def _set(d: dict[Any, Any], k: Any, v: Any | None) -> None:
    if v is None:
        d.pop(k, None)
    else:
        d[k] = v
