"""Who may see the console: admins only.

With TLS (the default) the console listens with the scheduler's certificate and ``CERT_REQUIRED``, and each
request's caller is the identity its client certificate proves (:class:`mesh.pki.peers.TlsPeers`, the same
per-connection checks as the edge API):

    caller                                      answer
    no certificate / another CA / expired       refused at the handshake (no connection)
    revoked / malformed certificate             401, and the connection is closed
    a tenant, site or scheduler certificate     403: the console shows every tenant's traffic
    an admin certificate                        served

Without TLS (``--insecure``, development only) a bearer token stands in for the certificate: the
``Authorization: Bearer <token>`` header, or the ``tiermesh_console`` cookie that ``/?token=<token>`` sets
(a browser cannot add headers to an address typed by hand). Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from mesh.errors import MeshError, PermissionDenied, Unauthenticated
from mesh.pki.identity import Identity
from mesh.pki.peers import TlsPeers

__all__ = ["ADMIN", "COOKIE", "AdminGate"]

COOKIE = "tiermesh_console"
ADMIN: web.RequestKey[str] = web.RequestKey("admin", str)  # the admitted admin's name, for handlers
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdminGate:
    """An aiohttp middleware admitting admins: ``tls`` (client certificates) or ``token`` (insecure mode)."""

    def __init__(self, *, tls: TlsPeers | None = None, token: str | None = None) -> None:
        if (tls is None) == (token is None):
            raise ValueError("the console needs exactly one of a TLS identity check or a token")
        if token is not None and len(token) < 16:
            raise ValueError("a console token must be at least 16 characters")
        self.tls = tls
        self.token = token

    def admin(self, request: web.Request) -> str:
        """The admin's name (``token`` in insecure mode); ``Unauthenticated`` / ``PermissionDenied`` otherwise."""
        if self.tls is not None:
            identity: Identity = self.tls.identify(request.transport)
            if identity.kind != "admin":
                raise PermissionDenied(f"{identity} is a {identity.kind}: the console is for admins only",
                                       reason="wrong_kind")
            return identity.name
        assert self.token is not None
        offered = _bearer(request) or request.cookies.get(COOKIE, "")
        if not offered or not hmac.compare_digest(offered.encode(), self.token.encode()):
            raise Unauthenticated("the console needs its token (printed by `tiermesh up`)", reason="no_token")
        return "token"

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        if self.token is not None and request.path == "/" and "token" in request.query:
            # the address `tiermesh up` prints: swap the token for a cookie and drop it from the address bar
            if not hmac.compare_digest(request.query["token"].encode(), self.token.encode()):
                return _refuse(Unauthenticated("wrong console token", reason="bad_token"), request)
            resp = web.Response(status=302, headers={"Location": "/"})
            resp.set_cookie(COOKIE, self.token, httponly=True, samesite="Strict", path="/")
            return resp
        try:
            request[ADMIN] = self.admin(request)
        except (Unauthenticated, PermissionDenied) as exc:
            return _refuse(exc, request)
        return await handler(request)


def _bearer(request: web.Request) -> str:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _refuse(exc: MeshError, request: web.Request) -> web.Response:
    if request.path.startswith("/api/"):
        resp: web.Response = web.json_response(exc.to_dict(), status=exc.http_status)
    else:
        title = "403 forbidden" if exc.http_status == 403 else "401 unauthenticated"
        resp = web.Response(status=exc.http_status, content_type="text/html",
                            text=f"<!doctype html><title>{title}</title><h1 id='refused'>{title}</h1>"
                                 f"<p>{_html(exc.message)}</p>")
    if exc.http_status == 401:
        resp.force_close()
    return resp


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
