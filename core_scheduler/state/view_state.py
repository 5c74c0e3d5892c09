"""What a cluster view holds at one moment: every followed key's record, by kind (:class:`ViewState`).

A :class:`~core_scheduler.state.view.MeshView` holds one and changes it key by key as watch events come; a full
re-read builds a new one aside and the view swaps it in whole, so readers never see a half-read view and a read
that fails leaves the last good one in force. A value that does not decode (:func:`records.decode_record`)
changes nothing: the key keeps its last good record (a new state takes it from the one it replaces), and the
refusal is noted in ``rejected`` for the view to report.

Variant ids are unique across tasks (placements and heartbeats name a variant by its id alone:
:mod:`variant_store.catalog_check`). Every decoded variant entry is held as a claim on its id; ``variants`` holds
the claim made first (lowest create revision) and the others are skipped, each noted in ``rejected`` with the
task that holds the id, until that one is removed. So a duplicate written straight into etcd never reaches the
snapshot builder (it raised ``appears twice`` on every rebuild) and never hides the task that had the id first.

Calibrated cascades (``cascades/<task>/<id>``, issue 33) are held in ``cascades`` (task -> id -> ``CascadeMeta``),
decoded by :func:`variant_store.cascade_catalog.decode_cascade` as hostile input: one that does not decode keeps the
key's last good entry and is noted in ``rejected``; their changes count under the kind ``"cascade"`` in ``revisions``.
Whether a cascade's stages are still catalogued is the reader's check (the snapshot builder's). Pipelines
(``pipelines/<task>``, issue 33) are held in ``pipelines`` (task -> ``PipelineMeta``) the same way, decoded by
:func:`variant_store.pipeline_catalog.decode_pipeline`, their changes counted under the kind ``"pipeline"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from core_scheduler.state.heartbeat import Heartbeat
from core_scheduler.state.records import decode_record
from mesh.errors import ProtocolError
from mesh.etcd.keys import CASCADES, PIPELINES, KeyKind, catalog_key, parse_key
from mesh.types import TaskSignature
from topology.schema import Link, Site, Tenant, Topology
from variant_store.cascade_catalog import decode_cascade
from variant_store.cascade_meta import CascadeMeta
from variant_store.catalog_check import Claim, shadowed_reason, winners
from variant_store.meta import VariantMeta
from variant_store.pipeline_catalog import decode_pipeline
from variant_store.pipeline_meta import PipelineMeta

__all__ = ["ViewKind", "ViewState"]

ViewKind = KeyKind | Literal["cascade", "pipeline"]  # what a put or delete changed


@dataclass(eq=False)
class ViewState:
    sites: dict[str, Site] = field(default_factory=dict)
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    variants: dict[str, dict[str, VariantMeta]] = field(default_factory=dict)
    cascades: dict[str, dict[str, CascadeMeta]] = field(default_factory=dict)  # task -> cascade id -> entry
    pipelines: dict[str, PipelineMeta] = field(default_factory=dict)  # task -> its graph (a task of tasks)
    signatures: dict[str, TaskSignature] = field(default_factory=dict)
    live: dict[str, Heartbeat] = field(default_factory=dict)
    placement: dict[str, dict[str, Any]] = field(default_factory=dict)
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    site_certs: dict[str, bytes] = field(default_factory=dict)
    crls: dict[str, bytes] = field(default_factory=dict)  # the one list at pki/crl, under "" (as a key of its own)
    revisions: dict[str, int] = field(default_factory=dict)       # kind -> revision of its last change
    live_revision: dict[str, int] = field(default_factory=dict)   # site -> revision of the heartbeat held
    rejected: dict[str, str] = field(default_factory=dict)        # key -> why its value was refused
    # variant id -> task -> (create revision, record): every decoded variant entry; ``variants`` holds the winners
    claims: dict[str, dict[str, tuple[int, VariantMeta]]] = field(default_factory=dict)
    _topology: Topology | None = None
    _shadowed: set[str] = field(default_factory=set)                        # keys skipped as duplicate ids
    _displaced: list[tuple[str, ProtocolError]] = field(default_factory=list)  # newly skipped other keys

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

    def put(self, key: str, value: Any, revision: int = 0, *, before: ViewState | None = None,
            created: int = 0) -> ViewKind | ProtocolError | None:
        """``key`` now holds ``value``. Returns the kind that changed, the ``ProtocolError`` of a value refused
        (the key keeps its record, or takes the one ``before`` held) or of a variant skipped as a duplicate id,
        or ``None`` for a key no view follows. ``created``: the key's create revision, when the reader knows it
        (a watch event does not say: a new key's first revision is its creation)."""
        if key.startswith(CASCADES):
            return self._put_cascade(key, value, revision, before)
        if key.startswith(PIPELINES):
            return self._put_pipeline(key, value, revision, before)
        parsed = parse_key(key)
        if parsed is None:
            return None
        kind, names = parsed
        try:
            record = decode_record(kind, names, value)
        except ProtocolError as exc:
            self.rejected[key] = exc.message
            if before is not None and (kept := before._get(kind, names)) is not None:
                if kind == "variant":
                    self._claim(names, kept, before.claims[names[1]][names[0]][0])
                else:
                    self._set(kind, names, kept, before.live_revision.get(names[0], 0) if kind == "live" else 0)
            return exc
        self.rejected.pop(key, None)
        if kind == "variant":
            self._shadowed.discard(key)  # settled again by the claim
            self._claim(names, record, created or revision)
        else:
            self._set(kind, names, record, revision)
        self.revisions[kind] = max(self.revisions.get(kind, 0), revision)
        if key in self._shadowed:
            return ProtocolError(self.rejected[key])
        return kind

    def _put_cascade(self, key: str, value: Any, revision: int, before: ViewState | None) -> ViewKind | ProtocolError:
        cnames = _cascade_names(key)
        try:
            if cnames is None:
                raise ValueError("a cascade's key is cascades/<task>/<id>")
            meta = decode_cascade(key, value)
        except Exception as exc:  # hostile: whatever the value raises, the key keeps its last good entry
            err = ProtocolError(f"bad cascade value: {type(exc).__name__}: {str(exc)[:200]}")
            self.rejected[key] = err.message
            kept = before.cascades.get(cnames[0], {}).get(cnames[1]) if before is not None and cnames else None
            if kept is not None and cnames is not None:
                self.cascades.setdefault(cnames[0], {})[cnames[1]] = kept
            return err
        self.rejected.pop(key, None)
        self.cascades.setdefault(meta.task, {})[meta.cascade_id] = meta
        self.revisions["cascade"] = max(self.revisions.get("cascade", 0), revision)
        return "cascade"

    def _put_pipeline(self, key: str, value: Any, revision: int, before: ViewState | None) -> ViewKind | ProtocolError:
        task = key[len(PIPELINES):]
        try:
            meta = decode_pipeline(key, value)
        except Exception as exc:  # hostile: whatever the value raises, the key keeps its last good entry
            err = ProtocolError(f"bad pipeline value: {type(exc).__name__}: {str(exc)[:200]}")
            self.rejected[key] = err.message
            kept = before.pipelines.get(task) if before is not None else None
            if kept is not None:
                self.pipelines[task] = kept
            return err
        self.rejected.pop(key, None)
        self.pipelines[meta.task] = meta
        self.revisions["pipeline"] = max(self.revisions.get("pipeline", 0), revision)
        return "pipeline"

    def take_displaced(self) -> list[tuple[str, ProtocolError]]:
        """Keys other than the one just put or deleted that became skipped duplicates (for the view to report)."""
        out, self._displaced = self._displaced, []
        return out

    def _claim(self, names: tuple[str, ...], record: VariantMeta | None, created: int) -> None:
        """Task ``names[0]``'s entry for id ``names[1]`` is now ``record`` (``None``: gone); settle who holds it."""
        task, vid = names
        claims = self.claims.setdefault(vid, {})
        if record is None:
            claims.pop(task, None)
            self.variants.get(task, {}).pop(vid, None)
            self._shadowed.discard(catalog_key(task, vid))
        else:
            old = claims.get(task)
            claims[task] = (old[0] if old is not None else created, record)
        if not claims:
            del self.claims[vid]
            return
        win = winners(Claim(t, vid, c) for t, (c, _) in claims.items())[vid].task
        for t, (_, meta) in claims.items():
            key = catalog_key(t, vid)
            if t == win:
                self.variants.setdefault(t, {})[vid] = meta
                if key in self._shadowed:
                    self._shadowed.discard(key)
                    self.rejected.pop(key, None)
                continue
            self.variants.get(t, {}).pop(vid, None)
            if key not in self._shadowed:
                self._shadowed.add(key)
                self.rejected[key] = shadowed_reason(vid, win)
                if t != task:
                    self._displaced.append((key, ProtocolError(self.rejected[key])))

    def delete(self, key: str, revision: int = 0) -> ViewKind | None:
        """``key`` is gone (with whatever it held, good or refused). Returns the kind that changed."""
        if key.startswith(CASCADES):
            self.rejected.pop(key, None)
            cnames = _cascade_names(key)
            if cnames is not None and self.cascades.get(cnames[0], {}).pop(cnames[1], None) is not None \
                    and not self.cascades[cnames[0]]:
                del self.cascades[cnames[0]]
            self.revisions["cascade"] = max(self.revisions.get("cascade", 0), revision)
            return "cascade"
        if key.startswith(PIPELINES):
            self.rejected.pop(key, None)
            self.pipelines.pop(key[len(PIPELINES):], None)
            self.revisions["pipeline"] = max(self.revisions.get("pipeline", 0), revision)
            return "pipeline"
        parsed = parse_key(key)
        if parsed is None:
            return None
        kind, names = parsed
        self.rejected.pop(key, None)
        if kind == "variant":
            self._claim(names, None, 0)
        else:
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
            held = self.claims.get(names[1], {}).get(names[0])
            return held[1] if held is not None else None
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


def _cascade_names(key: str) -> tuple[str, str] | None:
    parts = key[len(CASCADES):].split("/")
    return (parts[0], parts[1]) if len(parts) == 2 and all(parts) else None
