"""Waiting for a local mesh to be ready, by what its sites publish in etcd: live, placed, every public task
servable, self-profiling done. A mixin of :class:`tiermesh.harness.LocalMesh` (it reads the mesh's store,
catalog and sites)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from core_scheduler.state.heartbeat import Heartbeat
from core_scheduler.state.records import decode_record
from mesh.errors import MeshError, ProtocolError
from mesh.etcd.keys import live_key
from mesh.log import get_logger, kv

if TYPE_CHECKING:
    from mesh.etcd.keys import KeyKind
    from mesh.etcd.store import Store
    from tiermesh.mesh_options import SiteProcess
    from variant_store.catalog import Catalog

__all__ = ["Readiness"]

log = get_logger("tiermesh.harness")


class Readiness:
    store: Store | None
    catalog: Catalog | None
    sites: dict[str, SiteProcess]

    def running_sites(self) -> list[str]:
        """The sites whose agent runs (not one yet to join, nor one killed)."""
        return [name for name, sp in self.sites.items() if sp.proc is not None]

    async def _record(self, kind: KeyKind, key: str, name: str) -> Any:
        """``name``'s record at ``key``, decoded as the view decodes one (``core_scheduler.state.records``: a site
        writes its own live record, so any bytes). ``None``: none, or one that does not decode, which no wait here
        takes for done."""
        assert self.store is not None
        got = await self.store.get(key)
        if got is None:
            return None
        try:
            return decode_record(kind, (name,), got.value)
        except ProtocolError as exc:
            log.warning("site %s's %s record does not decode: %s", name, kind, exc, extra=kv(event="record_malformed"))
            return None

    async def _heartbeat(self, name: str) -> Heartbeat | None:
        hb: Heartbeat | None = await self._record("live", live_key(name), name)
        return hb

    async def wait_live(self, names: list[str] | None = None, timeout: float = 30.0) -> None:  # noqa: ASYNC109
        assert self.store is not None
        deadline = time.monotonic() + timeout
        for name in names or self.running_sites():
            while await self.store.get(live_key(name)) is None:
                if time.monotonic() > deadline:
                    raise MeshError(f"site {name} not live after {timeout} s")
                await asyncio.sleep(0.1)

    async def _placed_and_live(self) -> list[tuple[str, set[str] | None, Heartbeat | None]]:
        """Per site: the variants its placement asks for and its live record (``None`` where there is none, or
        where it does not decode)."""
        out: list[tuple[str, set[str] | None, Heartbeat | None]] = []
        for name in self.running_sites():
            place = await self._record("placement", f"placement/{name}", name)
            out.append((name, None if place is None else {v["variant_id"] for v in place["variants"]},
                        await self._heartbeat(name)))
        return out

    async def wait_placed(self, timeout: float = 60.0) -> None:  # noqa: ASYNC109
        """Until every site holds what its placement asks (or the timeout: placement keeps going)."""
        assert self.store is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = 0
            for _, want, live in await self._placed_and_live():
                if want is None or live is None:
                    pending += 1
                    continue
                pending += len(want - set(live.loaded))
            if pending == 0:
                return
            await asyncio.sleep(0.25)
        log.warning("placement not complete after %.0f s", timeout, extra=kv(event="placement_wait"))

    async def wait_servable(self, timeout: float = 60.0) -> dict[str, int]:  # noqa: ASYNC109
        """Until every site is live and every public task of the catalog has a variant placement asked for
        loaded somewhere, so the mesh answers every task (on a capped mesh: some site has timed one under its
        cap and placement has put it there; a tenant's private task is placed when its demand comes), or
        the timeout. Placed variants still loading and timings still running go on in the background.
        Returns what each site still has to time under its cap."""
        assert self.store is not None and self.catalog is not None
        deadline = time.monotonic() + timeout
        metas = await self.catalog.list_variants()
        tasks = {m.variant_id: m.task for m in metas}
        public = {m.task for m in metas if m.owner == "public"}
        while True:
            served: set[str] = set()
            dead: list[str] = []
            pending: dict[str, int] = {}
            for name, want, live in await self._placed_and_live():
                if live is None:
                    dead.append(name)
                    continue
                served |= {tasks.get(v, "") for v in (want or set()) & set(live.loaded)}
                if left := live.profiling_pending:
                    pending[name] = left
            missing = public - served
            if not dead and not missing:
                return pending
            if time.monotonic() > deadline:
                log.warning("after %.0f s: sites not live %s; public tasks with nothing placed and loaded %s",
                            timeout, dead, sorted(missing), extra=kv(event="servable_wait"))
                return pending
            await asyncio.sleep(0.1)

    async def wait_profiled(self, timeout: float = 120.0) -> dict[str, int]:  # noqa: ASYNC109
        """Until no site has variants left to profile for its (capped) hardware class, or the timeout;
        returns what each site still had pending (empty when all are done)."""
        assert self.store is not None
        deadline = time.monotonic() + timeout
        pending: dict[str, int] = {}
        while time.monotonic() < deadline:
            pending = {}
            for name in self.running_sites():
                hb = await self._heartbeat(name)
                left = hb.profiling_pending if hb is not None else -1
                if left != 0:
                    pending[name] = left
            if not pending:
                return {}
            await asyncio.sleep(0.5)
        log.warning("sites still profiling after %.0f s: %s", timeout, pending, extra=kv(event="profile_wait"))
        return pending

    async def wait_quiet(self, timeout: float = 20.0) -> list[str]:  # noqa: ASYNC109
        """Until no site is loading a variant, owes a heap thaw or has variants left to profile (its live record's
        ``settling`` and ``profiling_pending``), or the timeout; returns the sites still settling (empty when all
        are quiet).

        A load or a thaw blocks a site's event loop for its CPU time, which a tenth of a core stretches tenfold: a
        thaw after the start's unloads stalled a 0.1-core edge for 0.5-1.4 s (issue 30's demo, measured with a
        watchdog thread), and queries that came in then were refused ``stalled`` or ``deadline``. "mesh up", and
        the end of a warm-up, wait for that work rather than hand it to the first queries."""
        assert self.store is not None
        deadline = time.monotonic() + timeout
        busy: list[str] = []
        while time.monotonic() < deadline:
            busy = []
            for name in self.running_sites():
                hb = await self._heartbeat(name)
                if hb is None or hb.settling or hb.profiling_pending:
                    busy.append(name)
            if not busy:
                return []
            await asyncio.sleep(0.25)
        log.warning("sites still loading or settling their heap after %.0f s: %s", timeout, busy,
                    extra=kv(event="quiet_wait"))
        return busy
