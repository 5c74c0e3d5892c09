"""Topology <-> etcd: read the applied topology, diff it against a desired one, apply it atomically.

Key layout (relative to the Store prefix, names from :mod:`mesh.etcd.keys`): ``topology/sites/<name>``,
``topology/links/<a>/<b>`` (a < b), ``tenants/<name>``, each holding the object's JSON with
``"schema": 1``; and ``topology/meta`` = ``{"schema": 1, "digest": <sha256 of the canonical
topology>}``. The digest is of the content, not of the file's bytes, so re-applying a file whose
comments or key order changed is still a no-op.

``apply`` is one etcd transaction guarded by the mod revisions it read (``topology/meta`` is
always compared, so two concurrent applies cannot interleave), retried a few times on conflict.
It writes only keys whose value changed: re-applying the same topology writes nothing and does
not move the revision, so watchers (agents, the scheduler) see nothing to do. An apply that changes
something also records, in the same transaction, what it changed at ``topology/last_apply``
(:func:`last_apply_record`: the diff, when, and the source text if the caller passes it) for the console.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from mesh.backoff import Backoff
from mesh.errors import ConflictError, StoreError
from mesh.etcd.keys import LINKS, SITES, TENANTS, TOPOLOGY_LAST_APPLY, TOPOLOGY_META, link_key, site_key, tenant_key
from mesh.etcd.ops import KV, Compare, CreateRevision, Delete, ModRevision, Op, Put
from mesh.etcd.store import Store
from mesh.log import get_logger, kv
from topology.schema import SCHEMA_VERSION, Link, Site, Tenant, Topology

__all__ = [
    "MAX_SOURCE_BYTES",
    "MAX_TXN_OPS",
    "META_KEY",
    "Diff",
    "apply",
    "desired_state",
    "diff",
    "last_apply_record",
    "load_topology",
    "read_state",
]

log = get_logger(__name__)

META_KEY = TOPOLOGY_META
# etcd's default --max-txn-ops; a bigger change would be refused by the server, so say so first.
MAX_TXN_OPS = 128
# the source text kept beside the last apply's diff; etcd values stop at ~1.5 MB, a topology is a few KB
MAX_SOURCE_BYTES = 256 * 1024
_TOPOLOGY_PREFIX = "topology/"


@dataclass(frozen=True)
class Diff:
    """Keys to add, remove, or change (``changed[key] = (old, new)``), sorted by key."""

    added: dict[str, Any] = field(default_factory=dict)
    removed: dict[str, Any] = field(default_factory=dict)
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def keys(self) -> list[str]:
        return sorted([*self.added, *self.removed, *self.changed])

    def __len__(self) -> int:
        return len(self.added) + len(self.removed) + len(self.changed)

    def summary(self) -> str:
        return f"{len(self.added)} added, {len(self.changed)} changed, {len(self.removed)} removed"


def diff(current: dict[str, Any], desired: dict[str, Any]) -> Diff:
    """Pure key-by-key comparison of two ``{key: value}`` maps (values compared as parsed JSON)."""
    added = {k: desired[k] for k in sorted(desired) if k not in current}
    removed = {k: current[k] for k in sorted(current) if k not in desired}
    changed = {k: (current[k], desired[k]) for k in sorted(desired)
               if k in current and current[k] != desired[k]}
    return Diff(added=added, removed=removed, changed=changed)


def desired_state(topo: Topology) -> dict[str, Any]:
    """The ``{key: value}`` map a topology occupies in etcd, without ``topology/meta``."""
    out: dict[str, Any] = {}
    for s in topo.sites.values():
        out[site_key(s.name)] = s.to_dict()
    for lk in topo.links:
        out[link_key(lk.a, lk.b)] = lk.to_dict()
    for t in topo.tenants.values():
        out[tenant_key(t.name)] = t.to_dict()
    return out


def _meta(topo: Topology) -> dict[str, Any]:
    return {"schema": SCHEMA_VERSION, "digest": topo.digest()}


async def read_state(store: Store) -> tuple[dict[str, KV], KV | None]:
    """Topology keys as stored (sites, links, tenants) and the meta record, if any."""
    # One range over topology/ returns sites, links and meta at a single revision.
    topo_kvs, tenant_kvs = await asyncio.gather(store.get_prefix(_TOPOLOGY_PREFIX), store.get_prefix(TENANTS))
    state: dict[str, KV] = {}
    meta: KV | None = None
    for item in [*topo_kvs, *tenant_kvs]:
        if item.key == META_KEY:
            meta = item
        elif item.key.startswith((SITES, LINKS, TENANTS)):
            state[item.key] = item
    return state, meta


def _check_schema(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise StoreError(f"etcd key {key!r} does not hold a JSON object")
    if value.get("schema") != SCHEMA_VERSION:
        raise StoreError(f"etcd key {key!r} has schema {value.get('schema')!r}; "
                         f"this tiermesh reads {SCHEMA_VERSION}")
    return value


async def load_topology(store: Store) -> Topology | None:
    """The applied topology, or None when no site has been applied under this prefix."""
    state, _ = await read_state(store)
    sites: dict[str, Site] = {}
    links: list[Link] = []
    tenants: dict[str, Tenant] = {}
    try:
        for key, item in state.items():
            value = _check_schema(key, item.value)
            if key.startswith(SITES):
                s = Site.from_dict(value)
                sites[s.name] = s
            elif key.startswith(LINKS):
                links.append(Link.from_dict(value))
            else:
                t = Tenant.from_dict(value)
                tenants[t.name] = t
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"malformed topology value in etcd: {exc!r}") from exc
    if not sites:
        return None
    return Topology(sites=sites, links=tuple(links), tenants=tenants, schema=SCHEMA_VERSION)


def last_apply_record(d: Diff, topo: Topology, *, source: str | None = None,
                      now: float | None = None) -> dict[str, Any]:
    """The ``topology/last_apply`` value: the diff key by key (``changed`` as ``{"old", "new"}``), its summary,
    the digest applied, the wall-clock time (for people), and ``source`` (the file's text) when given and
    not larger than ``MAX_SOURCE_BYTES`` (else ``source_omitted`` says why it is missing)."""
    record: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "ts": time.time() if now is None else now, "digest": topo.digest(),
        "summary": d.summary(), "added": d.added, "removed": d.removed,
        "changed": {k: {"old": old, "new": new} for k, (old, new) in d.changed.items()}, "source": None}
    if source is not None and len(source.encode()) <= MAX_SOURCE_BYTES:
        record["source"] = source
    elif source is not None:
        record["source_omitted"] = f"source larger than {MAX_SOURCE_BYTES} bytes"
    return record


async def apply(store: Store, topo: Topology, *, attempts: int = 5, source: str | None = None) -> Diff:
    """Make etcd hold exactly ``topo``; returns what changed (empty when it already did). ``source``: the
    topology file's text, kept with the record of this apply when it changes something."""
    desired = desired_state(topo)
    meta = _meta(topo)
    backoff = Backoff(0.02, 0.25, jitter="full")  # writers that lost a race spread out before they read again
    for attempt in range(attempts):
        state, meta_kv = await read_state(store)
        d = diff({k: v.value for k, v in state.items()}, desired)
        if d.empty and meta_kv is not None and meta_kv.value == meta:
            return d
        compares: list[Compare] = [ModRevision(k, "==", state[k].mod_revision)
                                   for k in (*d.changed, *d.removed)]
        compares += [CreateRevision(k, "==", 0) for k in d.added]
        compares.append(CreateRevision(META_KEY, "==", 0) if meta_kv is None
                        else ModRevision(META_KEY, "==", meta_kv.mod_revision))
        ops: list[Op] = [Put(k, v) for k, v in d.added.items()]
        ops += [Put(k, new) for k, (_, new) in d.changed.items()]
        ops += [Delete(k) for k in d.removed]
        ops.append(Put(META_KEY, meta))
        ops.append(Put(TOPOLOGY_LAST_APPLY, last_apply_record(d, topo, source=source)))
        if len(ops) > MAX_TXN_OPS:
            raise StoreError(f"topology change of {len(ops)} keys exceeds etcd's {MAX_TXN_OPS} operations "
                             f"per transaction; start etcd with a larger --max-txn-ops")
        result = await store.txn(compares, ops)
        if result.succeeded:
            log.info("topology applied: %s", d.summary(),
                     extra=kv(event="topology_applied", revision=result.revision, digest=meta["digest"][:12]))
            return d
        log.info("topology apply lost a race, retrying", extra=kv(event="topology_conflict", attempt=attempt))
        await asyncio.sleep(backoff.next())
    raise ConflictError(f"topology apply conflicted {attempts} times: another writer keeps changing it")
