"""Who may read which variant from the variant store over HTTPS: the caller's identity comes from its client
certificate (mesh CA, checked with a :class:`~mesh.pki.trust.TrustStore`: one URI SAN, clientAuth EKU, not a
CA, not revoked); what it may read from the variant's ``owner``:

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

import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

from aiohttp import web

from mesh.errors import PermissionDenied, PkiError, Unauthenticated
from mesh.lifecycle import Service
from mesh.pki.files import PkiPaths
from mesh.pki.identity import KINDS, Identity
from mesh.pki.reload import ReloadingCredentials
from mesh.pki.trust import TrustStore
from mesh.pki.verify import peer_certificate
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


class StoreTls(Service):
    """The variant store's mutual-TLS side: ``ssl_context`` for its listener (``identity``'s certificate, which
    needs the serverAuth EKU: a site or scheduler identity), ``peer(request)`` for the caller's identity.
    Certificates and the revocation list are re-read on change (``interval_s``)."""

    def __init__(self, paths: PkiPaths, identity: Identity, *, interval_s: float = 1.0) -> None:
        self.identity = identity
        try:
            self.credentials = ReloadingCredentials.for_identity(paths, identity, interval_s=interval_s)
            self.trust = TrustStore.under(paths, interval_s=interval_s)
        except PkiError as exc:
            raise PkiError(f"the variant store cannot serve HTTPS as {identity}: {exc} (issue it with "
                           f"`tiermesh pki issue`)") from exc
        self.ssl_context = self.credentials.server_context()
        # per connection: (identity or error, CA, CRL, expiry) so keep-alive requests pay the check once
        self._verdicts: weakref.WeakKeyDictionary[object, tuple[Identity | Unauthenticated | PermissionDenied,
                                                                object, object, float]] = \
            weakref.WeakKeyDictionary()

    @classmethod
    def under(cls, home: Path | str, identity: Identity, *, interval_s: float = 1.0) -> StoreTls:
        return cls(PkiPaths.under(home), identity, interval_s=interval_s)

    async def _start(self) -> None:
        await self.trust.start()
        await self.credentials.start()

    async def _stop(self) -> None:
        await self.credentials.stop()
        await self.trust.stop()

    def peer(self, request: web.Request) -> Identity:
        """The caller's verified identity; ``Unauthenticated`` (401) when its certificate proves none."""
        transport = request.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        if ssl_object is None:
            raise Unauthenticated("no TLS connection", reason="no_certificate")
        ca, crl = self.trust.ca, self.trust.crl
        v = self._verdicts.get(ssl_object)
        if v is None or v[1] is not ca or v[2] is not crl or time.time() > v[3]:
            try:
                cert = peer_certificate(ssl_object)
                found: Identity | Unauthenticated | PermissionDenied = self.trust.verify(cert, use="client",
                                                                                         kinds=KINDS)
                not_after = cert.not_valid_after_utc.timestamp()
            except (Unauthenticated, PermissionDenied) as exc:
                found, not_after = exc, float("inf")
            v = self._verdicts[ssl_object] = (found, ca, crl, not_after)
        if isinstance(v[0], Identity):
            return v[0]
        raise type(v[0])(v[0].message, **v[0].details)
