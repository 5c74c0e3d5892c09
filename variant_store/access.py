"""Who may read which variant from the variant store over HTTPS: the caller's identity comes from its client
certificate (mesh CA, checked by :class:`~mesh.pki.peers.TlsPeers`: one URI SAN, clientAuth EKU, not a CA, not
revoked); what it may read from the variant's ``owner``:

    variant owner          served to
    "public"               any valid identity
    tenant T (private)     tenant T; a site that serves T (``serves(site, T)``: every site by default, the
                           topology's tenants do not name sites); an admin (operators wrote the entry and
                           read it in etcd anyway)
                           everyone else (another tenant, a scheduler, a site not serving T): 403

A blob is readable when some variant it belongs to (its model or shared backbone) is; a blob no catalog
entry names yet is served to infrastructure identities only (sites, admins, schedulers), never to a tenant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from aiohttp import web

from mesh.errors import PkiError
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.pki.peers import TlsPeers
from variant_store.meta import VariantMeta

__all__ = ["PUBLIC", "Serves", "StoreTls", "blob_readable", "may_read"]

PUBLIC = "public"
Serves = Callable[[str, str], bool]  # (site, tenant) -> does that site serve that tenant


def _every_site(site: str, tenant: str) -> bool:
    return True


def may_read(identity: Identity, owner: str, serves: Serves = _every_site) -> bool:
    """Whether ``identity`` may read a variant (metadata or blob) owned by ``owner``."""
    if owner == PUBLIC:
        return True
    if identity.kind == "tenant":
        return identity.name == owner
    if identity.kind == "site":
        return serves(identity.name, owner)
    return identity.kind == "admin"


def blob_readable(identity: Identity, digest: str, metas: Iterable[VariantMeta], serves: Serves = _every_site) -> bool:
    owners = {m.owner for m in metas if digest in (m.blob_digest, m.shared_base_digest)}
    if not owners:
        return identity.kind != "tenant"
    return any(may_read(identity, o, serves) for o in owners)


class StoreTls(TlsPeers):
    """The variant store's mutual-TLS side: ``ssl_context`` for its listener (``identity``'s certificate, which
    needs the serverAuth EKU: a store, site or scheduler identity), ``peer(request)`` for the caller's identity.
    Certificates and the revocation list are re-read on change (``interval_s``); a newer list from etcd
    ``pki/crl`` comes in through :meth:`~mesh.pki.peers.TlsPeers.load_crl` (the serve command follows it), and
    either way a revoked caller's open keep-alive connections are closed (:class:`~mesh.pki.peers.TlsPeers`)."""

    def __init__(self, paths: PkiPaths, identity: Identity, *, interval_s: float = 1.0) -> None:
        try:
            super().__init__(paths, identity, interval_s=interval_s)
        except PkiError as exc:
            raise PkiError(f"the variant store cannot serve HTTPS as {identity}: {exc} (issue it with "
                           f"`tiermesh pki issue`)") from exc

    @classmethod
    def under(cls, home: Path | str, identity: Identity, *, interval_s: float = 1.0) -> StoreTls:
        return cls(PkiPaths.under(home), identity, interval_s=interval_s)

    def peer(self, request: web.Request) -> Identity:
        """The caller's verified identity; ``Unauthenticated`` (401) when its certificate proves none."""
        return self.identify(request.transport)
