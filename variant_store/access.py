"""Who may read what from the variant store over HTTPS: the caller's identity comes from its client certificate
(mesh CA, checked by :class:`~mesh.pki.peers.TlsPeers`: one URI SAN, clientAuth EKU, not a CA, not revoked, and not
etcd's own certificate, which no tiermesh server admits); what it may read from who owns the bytes:

    the blob (or catalog entry) is            served to
    a public variant's (model or backbone)    any caller
    tenant T's private variant's, or the      T; a site that serves T (``serves(site, T)``: placement asks that site
      parent model T registered                 for one of T's variants, now or within a grace, see
                                                :mod:`variant_store.placed`); admins; variant stores
    tenant T's private variant V's            also a site the scheduler leader assigned a chunk of a job of T on V
      (its ONNX and shared backbone)            (``granted`` holds (T, task, V): an assignment names it, now or
                                                within a grace, see :mod:`variant_store.job_grants`). That variant
                                                only, not T's others, and only while the catalog says V is T's
    a model's labelled validation set         the model's owner tenant (a private model's); admins; variant stores.
                                                Never a site or a scheduler: no site runs it, and labels are the
                                                owner's data
    named by nothing in the catalog           admins and variant stores
    everyone else                             403, without saying whether the blob exists

A blob named several times (a backbone shared by a public and a private variant) is readable when any naming
admits the caller. Catalog entries (``GET /catalog``) follow the variant rule.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from aiohttp import web

from mesh.errors import PkiError
from mesh.pki.files import PkiPaths
from mesh.pki.identity import CALLER_KINDS, Identity
from mesh.pki.peers import TlsPeers
from variant_store.catalog import RegisteredModel
from variant_store.job_grants import Granted
from variant_store.meta import PUBLIC, VariantMeta

__all__ = ["Serves", "StoreTls", "blob_readable", "job_granted", "may_read", "no_site", "site_tenants"]

Serves = Callable[[str, str], bool]  # (site, tenant) -> does that site serve that tenant
_OPERATORS = ("admin", "store")  # read everything: they wrote it, or mirror it


def no_site(site: str, tenant: str) -> bool:
    """The ``serves`` of a store that knows no placement: no site serves any tenant's private variants."""
    return False


def site_tenants(placed: Iterable[tuple[str, str]], metas: Iterable[VariantMeta]) -> frozenset[str]:
    """The tenants whose private variants are among ``placed`` ((task, variant id) pairs a site's placement
    asks for), by the catalog's ``metas``."""
    wanted = set(placed)
    return frozenset(m.owner for m in metas if m.owner != PUBLIC and (m.task, m.variant_id) in wanted)


def may_read(identity: Identity, owner: str, serves: Serves = no_site) -> bool:
    """Whether ``identity`` may read a variant (metadata or blob) owned by ``owner``."""
    if identity.kind not in CALLER_KINDS:
        return False
    if owner == PUBLIC or identity.kind in _OPERATORS:
        return True
    if identity.kind == "tenant":
        return identity.name == owner
    if identity.kind == "site":
        return serves(identity.name, owner)
    return False


def job_granted(identity: Identity, meta: VariantMeta, granted: Collection[Granted]) -> bool:
    """Whether ``identity`` is a site whose job assignments (``granted``) name variant ``meta``, of its owner."""
    return identity.kind == "site" and (meta.owner, meta.task, meta.variant_id) in granted


def _may_read_validation(identity: Identity, model: RegisteredModel) -> bool:
    if identity.kind in _OPERATORS:
        return True
    return identity.kind == "tenant" and model.owner != PUBLIC and identity.name == model.owner


def blob_readable(identity: Identity, digest: str, metas: Iterable[VariantMeta],
                  models: Iterable[RegisteredModel] = (), serves: Serves = no_site,
                  granted: Collection[Granted] = ()) -> bool:
    """Whether ``identity`` may read blob ``digest``, by what names it: ``metas`` (the variants) and ``models`` (the
    registered models: their parent ONNX and validation set)."""
    if identity.kind not in CALLER_KINDS:
        return False
    models = list(models)
    naming = [m for m in metas if digest in (m.blob_digest, m.shared_base_digest)]
    if granted and any(job_granted(identity, m, granted) for m in naming):
        return True
    owners = {m.owner for m in naming}
    owners |= {m.owner for m in models if m.parent_digest == digest}
    if any(may_read(identity, o, serves) for o in owners):
        return True
    validation = [m for m in models if m.validation_digest == digest]
    if any(_may_read_validation(identity, m) for m in validation):
        return True
    return not owners and not validation and identity.kind in _OPERATORS


class StoreTls(TlsPeers):
    """The variant store's mutual-TLS side: ``ssl_context`` for its listener (``identity``'s certificate, which
    needs the serverAuth EKU: a store, site or scheduler identity), ``peer(request)`` for the caller's identity.
    Certificates and the revocation list are re-read on change (``interval_s``); a newer list from etcd
    ``pki/crl`` comes in through :meth:`~mesh.pki.peers.TlsPeers.load_crl` (the serve command follows it), and
    either way a revoked caller's open keep-alive connections are closed (:class:`~mesh.pki.peers.TlsPeers`).
    etcd's own certificate is refused (403): it is etcd's, not a reader of models."""

    def __init__(self, paths: PkiPaths, identity: Identity, *, interval_s: float = 1.0) -> None:
        try:
            super().__init__(paths, identity, interval_s=interval_s, kinds=CALLER_KINDS)
        except PkiError as exc:
            raise PkiError(f"the variant store cannot serve HTTPS as {identity}: {exc} (issue it with "
                           f"`tiermesh pki issue`)") from exc

    @classmethod
    def under(cls, home: Path | str, identity: Identity, *, interval_s: float = 1.0) -> StoreTls:
        return cls(PkiPaths.under(home), identity, interval_s=interval_s)

    def peer(self, request: web.Request) -> Identity:
        """The caller's verified identity; ``Unauthenticated`` (401) when its certificate proves none,
        ``PermissionDenied`` (403) for etcd's own certificate."""
        return self.identify(request.transport)
