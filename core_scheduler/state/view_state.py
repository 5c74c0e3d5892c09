"""What a cluster view holds at one moment: every followed key's record, by kind (:class:`ViewState`).

A :class:`~core_scheduler.state.view.MeshView` holds one and changes it key by key as watch events come; a full
re-read builds a new one aside and the view swaps it in whole, so readers never see a half-read view and a read
that fails leaves the last good one in force. A value that does not decode (:func:`records.decode_record`)
changes nothing: the key keeps its last good record (a new state takes it from the one it replaces), and the
refusal is noted in ``rejected`` for the view to report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core_scheduler.state.heartbeat import Heartbeat
from core_scheduler.state.records import decode_record
from mesh.errors import ProtocolError
from mesh.etcd.keys import KeyKind, parse_key
from mesh.types import TaskSignature
from topology.schema import Link, Site, Tenant, Topology
from variant_store.meta import VariantMeta

__all__ = ["ViewState"]


@dataclass(eq=False)
class ViewState:
    sites: dict[str, Site] = field(default_factory=dict)
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    variants: dict[str, dict[str, VariantMeta]] = field(default_factory=dict)
    signatures: dict[str, TaskSignature] = field(default_factory=dict)
    live: dict[str, Heartbeat] = field(default_factory=dict)
    placement: dict[str, dict[str, Any]] = field(default_factory=dict)
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    site_certs: dict[str, bytes] = field(default_factory=dict)
    crls: dict[str, bytes] = field(default_factory=dict)  # the one list at pki/crl, under "" (as a key of its own)
    revisions: dict[str, int] = field(default_factory=dict)       # kind -> revision of its last change
    live_revision: dict[str, int] = field(default_factory=dict)   # site -> revision of the heartbeat held
    rejected: dict[str, str] = field(default_factory=dict)        # key -> why its value was refused
    _topology: Topology | None = None

    @property
    def crl(self) -> bytes | None:
        return self.crls.get("")

    @property
    def topology(self) -> Topology | None:
        """The sites, links and tenants as one topology (built once per change); links to a site it lacks are
        left out (a site and its links leave in one apply, but a reader may see them go one by one)."""
        if self._topology is None and self.sites:
            self._topology = Topology(sites=dict(self.sites), tenants=dict(self.tenants),
                                      links=tuple(lk for lk in self.links.values()
                                                  if lk.a in self.sites and lk.b in self.sites))
        return self._topology

    def put(self, key: str, value: Any, revision: int = 0, *,
            before: ViewState | None = None) -> KeyKind | ProtocolError | None:
        """``key`` now holds ``value``. Returns the kind that changed, the ``ProtocolError`` of a value refused
        (the key keeps its record, or takes the one ``before`` held), or ``None`` for a key no view follows."""
        parsed = parse_key(key)
        if parsed is None:
            return None
        kind, names = parsed
        try:
            record = decode_record(kind, names, value)
        except ProtocolError as exc:
            self.rejected[key] = exc.message
            if before is not None and (kept := before._get(kind, names)) is not None:
                self._set(kind, names, kept, before.live_revision.get(names[0], 0) if kind == "live" else 0)
            return exc
        self.rejected.pop(key, None)
        self._set(kind, names, record, revision)
        self.revisions[kind] = max(self.revisions.get(kind, 0), revision)
        return kind

    def delete(self, key: str, revision: int = 0) -> KeyKind | None:
        """``key`` is gone (with whatever it held, good or refused). Returns the kind that changed."""
        parsed = parse_key(key)
        if parsed is None:
            return None
        kind, names = parsed
        self.rejected.pop(key, None)
        self._set(kind, names, None, revision)
        self.revisions[kind] = max(self.revisions.get(kind, 0), revision)
        return kind

    def _slot(self, kind: KeyKind, names: tuple[str, ...]) -> tuple[dict[Any, Any], Any]:
        """The dict holding a key's record, and its key there."""
        if kind == "link":
            return self.links, (names[0], names[1])
        if kind == "variant":
            return self.variants.setdefault(names[0], {}), names[1]
        if kind == "crl":
            return self.crls, ""
        table: dict[str, dict[Any, Any]] = {
            "site": self.sites, "tenant": self.tenants, "task": self.signatures, "live": self.live,
            "placement": self.placement, "service": self.services, "site_cert": self.site_certs}
        return table[kind], names[0]

    def _get(self, kind: KeyKind, names: tuple[str, ...]) -> Any | None:
        if kind == "variant":
            return self.variants.get(names[0], {}).get(names[1])
        d, k = self._slot(kind, names)
        return d.get(k)

    def _set(self, kind: KeyKind, names: tuple[str, ...], record: Any | None, revision: int) -> None:
        d, k = self._slot(kind, names)
        if record is None:
            d.pop(k, None)
        else:
            d[k] = record
        if kind in ("site", "link", "tenant"):
            self._topology = None
        if kind == "live":
            self.live_revision.pop(names[0], None)
            if record is not None:
                self.live_revision[names[0]] = revision
