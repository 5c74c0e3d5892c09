"""Mutual TLS at the edge: the site's server credentials, and which tenant a caller is from its client
certificate.

The per-connection checks (handshake, then SAN, EKU, revocation; cached per connection; revoked callers' idle
connections swept) are :class:`mesh.pki.peers.TlsPeers`, shared with the admin console. What the edge adds is
its rule of who may call the inference API:

    caller                                    answer
    no certificate / another CA / expired     refused at the handshake (TLS 1.3: a reset at its first request)
    revoked / bad SAN / CA:TRUE / wrong EKU   401 unauthenticated, and the connection is closed
    a site, admin or scheduler identity       403 forbidden on the tenant API (health endpoints admit any)
    tenant header or ``tenant`` parameter     403 forbidden when it names another tenant than the certificate
    tenant header twice, or listing several   400 bad request (which one counted depended on the reader)

The TLS handshake itself, and how many connections may be in it, is bounded by the HTTP front's connection
guard (``edge_agent.http_api.ConnectionGuard``), which starts TLS on each accepted socket with this context.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from mesh.errors import PermissionDenied, PkiError
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.pki.peers import TlsPeers
from mesh.v2.body import TENANT_HEADER, tenant_claim

__all__ = ["EdgeTls"]

_NONE: list[str] = []  # getall's default: never mutated


class EdgeTls(TlsPeers):
    """The edge's mutual-TLS side: ``ssl_context`` for the listener, ``tenant`` / ``peer`` for the handlers."""

    def __init__(self, paths: PkiPaths, site: str, *, interval_s: float = 1.0) -> None:
        try:
            super().__init__(paths, Identity("site", site), interval_s=interval_s)
        except PkiError as exc:
            raise PkiError(f"site {site} cannot serve HTTPS: {exc} (create them with `tiermesh pki init` and "
                           f"`tiermesh pki issue --site {site} --address HOST`, or run with --insecure)") from exc

    @classmethod
    def under(cls, home: Path | str, site: str, *, interval_s: float = 1.0) -> EdgeTls:
        return cls(PkiPaths.under(home), site, interval_s=interval_s)

    def peer(self, request: web.Request) -> Identity:
        """The caller's verified identity, of any kind; ``Unauthenticated`` (401) if it proves none."""
        return self.identify(request.transport)

    def tenant(self, request: web.Request) -> str:
        """The tenant the client certificate names. A site (or admin, scheduler) identity is not a tenant (403);
        a tenant header naming another tenant is refused (403): identity comes from the certificate only."""
        return self.tenant_of(request.transport, request.headers.getall(TENANT_HEADER, _NONE))

    def tenant_of(self, transport: asyncio.BaseTransport | None, claims: list[str]) -> str:
        """:meth:`tenant` for any front (gRPC's too): the caller on ``transport``, ``claims`` the tenant header's
        values (gRPC metadata ``x-tiermesh-tenant``)."""
        identity = self.identify(transport)
        if identity.kind != "tenant":
            raise PermissionDenied(f"{identity} is a {identity.kind}, not a tenant: the inference API serves "
                                   f"tenants", reason="wrong_kind")
        claimed = tenant_claim(claims)  # once, one name: else a 400
        if claimed is not None and claimed != identity.name:
            raise PermissionDenied(f"header {TENANT_HEADER}: {claimed!r} does not match the client "
                                   f"certificate's tenant {identity.name!r}", reason="tenant_mismatch")
        return identity.name
