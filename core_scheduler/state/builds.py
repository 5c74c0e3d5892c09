"""Tenants' model builds in etcd, as a door reads and writes them (``edge_agent.models_api``): creating a build
request, reading a build (request and state), listing a tenant's, and waiting for a build to change. The variant
store's side (claiming and running builds, writing their state) is ``variant_store.tenant_builds``.

Keys (``mesh.etcd.keys``): ``builds/<tenant>/<id>`` (a :class:`~mesh.buildspec.BuildRequest`, created once: the CAS
is "absent") and ``buildstate/<id>`` (a :class:`~mesh.buildspec.BuildState`, the store's alone). A request whose
tenant or id disagrees with its key is treated as absent (a site wrote it wrongly: nobody's build).

Every value read back is decoded as hostile; a list skips what it cannot read and says so in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from mesh.buildspec import BuildRequest, BuildState, build_status, is_build_id
from mesh.errors import ConflictError, ProtocolError, StoreError
from mesh.etcd.keys import BUILD_STATE, BUILDS, build_key, build_state_key, build_tenant_prefix
from mesh.etcd.ops import CreateRevision, Put
from mesh.etcd.store import Store
from mesh.etcd.watch import KeyRange
from mesh.log import get_logger, kv

__all__ = ["BuildBook", "BuildView"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class BuildView:
    """A build's request, its state (None: queued) and the state record's revision (0: none)."""

    request: BuildRequest
    state: BuildState | None
    revision: int

    @property
    def terminal(self) -> bool:
        return self.state is not None and self.state.terminal

    @property
    def live(self) -> bool:
        """Queued or running: it may still catalogue variants."""
        return not self.terminal

    def to_json(self) -> dict[str, Any]:
        return build_status(self.request, self.state)


def _request(key: str, value: object) -> BuildRequest:
    req = BuildRequest.from_json(value)
    if key != build_key(req.tenant, req.build_id):
        raise ProtocolError(f"build request at {key[:120]!r} names tenant {req.tenant!r} and id {req.build_id}")
    return req


class BuildBook:
    """The door's build operations over one :class:`Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def create(self, req: BuildRequest) -> None:
        """Write a new request (``ConflictError`` if its id exists: ids are random, so only a bug or a forger)."""
        key = build_key(req.tenant, req.build_id)
        res = await self.store.txn([CreateRevision(key, "==", 0)], [Put(key, req.to_json())])
        if not res.succeeded:
            raise ConflictError(f"build {req.build_id} exists already", key=key)

    async def state(self, build_id: str) -> tuple[BuildState | None, int]:
        got = await self.store.get(build_state_key(build_id))
        if got is None:
            return None, 0
        st = BuildState.from_json(got.value)
        if st.build_id != build_id:
            raise ProtocolError(f"build state {build_id} names build {st.build_id}")
        return st, got.mod_revision

    async def view(self, tenant: str, build_id: str) -> BuildView | None:
        """``tenant``'s build ``build_id``, or None (absent, another tenant's, or unreadable: logged)."""
        if not is_build_id(build_id):
            return None
        key = build_key(tenant, build_id)
        got = await self.store.get(key)
        if got is None:
            return None
        try:
            req = _request(key, got.value)
            st, rev = await self.state(build_id)
        except ProtocolError as exc:
            log.warning("unreadable build %s: %s", build_id, exc, extra=kv(event="build_unreadable", tenant=tenant))
            return None
        if st is not None and st.tenant != tenant:
            return None
        return BuildView(req, st, rev)

    async def views(self, tenant: str | None = None) -> list[BuildView]:
        """Every readable build (of ``tenant`` when given), newest first: one read of the requests, one of the
        states."""
        reqs = await self.store.get_prefix(build_tenant_prefix(tenant) if tenant is not None else BUILDS)
        states = {item.key[len(BUILD_STATE):]: item for item in await self.store.get_prefix(BUILD_STATE)}
        out = []
        for item in reqs:
            try:
                req = _request(item.key, item.value)
                got = states.get(req.build_id)
                st = BuildState.from_json(got.value) if got is not None else None
            except ProtocolError as exc:
                log.warning("unreadable build at %s: %s", item.key[:120], exc, extra=kv(event="build_unreadable"))
                continue
            if st is not None and (st.build_id, st.tenant) != (req.build_id, req.tenant):
                st = None  # a state that is not this build's: shown as queued, the store will say more
            out.append(BuildView(req, st, got.mod_revision if got is not None and st is not None else 0))
        return sorted(out, key=lambda v: -v.request.created)

    async def wait_change(self, build_id: str, after: int, timeout: float) -> bool:  # noqa: ASYNC109
        """Whether ``buildstate/<id>`` changed after revision ``after`` within ``timeout`` seconds (a long poll's
        wait: an etcd watch, never a timer). A failed watch answers True: the caller reads again and misses
        nothing."""
        watch = self.store.watch_ranges((KeyRange.key(build_state_key(build_id)),), start_revision=after + 1)
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                async for _ in watch:
                    return True
        except TimeoutError:
            return False
        except StoreError as exc:
            log.info("build watch failed: %s", exc, extra=kv(event="build_watch_retry"))
            return True
        finally:
            with contextlib.suppress(Exception):
                await watch.close()
        return True
