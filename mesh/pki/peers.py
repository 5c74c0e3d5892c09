"""A mutual-TLS server's view of its callers: its own credentials, and who each connection's client
certificate proves, checked once per connection and again when the trust material changes.

:class:`TlsPeers` holds the server's :class:`~mesh.pki.reload.ReloadingCredentials` (one server ``SSLContext``
with ``CERT_REQUIRED``, reloaded in place when its certificate is re-issued: no restart) and a
:class:`~mesh.pki.trust.TrustStore` (the CA and ``crl.pem``, re-read on change). TLS refuses at the handshake
a caller with no certificate, one from another CA, or one outside its validity; everything else (exactly one URI
SAN, not a CA, clientAuth EKU, not revoked) is checked by :meth:`TlsPeers.identify` after it:

    caller                                    answer
    no certificate / another CA / expired     refused at the handshake (TLS 1.3: a reset at its first request)
    revoked / bad SAN / CA:TRUE / wrong EKU   Unauthenticated (the server answers 401 and closes)
    anyone, while the list held is expired    Unauthenticated ``crl_expired`` (fail closed: :mod:`mesh.pki.crl`)
    an etcd identity (or a kind not in        PermissionDenied ``wrong_kind`` (403): etcd's certificate is for etcd
      ``kinds``)
    a valid identity                          that Identity; which kinds may do what is the server's rule

The verdict is cached per connection (its ``SSLObject``) and recomputed when the CA or the revocation list
changes or the certificate expires, so a keep-alive connection pays the full check once, and a revoked
caller is refused on its next request after ``crl.pem`` is re-read (``interval_s``) or a newer list arrives
from etcd ``pki/crl`` (:meth:`TlsPeers.load_crl`). Idle keep-alive connections are not left waiting for that
request: when the CA or the list changes, :meth:`TlsPeers.sweep` closes every open connection whose
certificate is no longer accepted.

The edge API (``edge_agent.mtls.EdgeTls``, tenants) and the admin console (admins) both stand on this; it knows
transports, not any HTTP framework.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import dataclass

from mesh.errors import PermissionDenied, Unauthenticated
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from mesh.pki.crl import RevocationList
from mesh.pki.files import PkiPaths
from mesh.pki.identity import CALLER_KINDS, Identity, Kind
from mesh.pki.reload import ReloadingCredentials
from mesh.pki.trust import TrustStore
from mesh.pki.verify import peer_certificate

__all__ = ["TlsPeers"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Verdict:
    identity: Identity | None
    error: Unauthenticated | PermissionDenied | None
    ca: object
    crl: RevocationList | None
    not_after: float  # wall-clock seconds: past it, check again (and refuse)


class TlsPeers(Service):
    """``ssl_context`` for a listener serving as ``identity``; :meth:`identify` for its handlers.
    ``PkiError`` at construction when the identity's certificate, key or the CA cannot be read."""

    def __init__(self, paths: PkiPaths, identity: Identity, *, interval_s: float = 1.0,
                 kinds: tuple[Kind, ...] = CALLER_KINDS) -> None:
        self.identity = identity
        self.kinds = kinds
        self.credentials = ReloadingCredentials.for_identity(paths, identity, interval_s=interval_s)
        self.trust = TrustStore.under(paths, interval_s=interval_s)
        self.ssl_context = self.credentials.server_context()
        self.interval_s = interval_s
        self._verdicts: weakref.WeakKeyDictionary[object, _Verdict] = weakref.WeakKeyDictionary()
        # connections whose caller was admitted, by transport (it holds its SSLObject, not the reverse)
        self._open: weakref.WeakKeyDictionary[asyncio.BaseTransport, object] = weakref.WeakKeyDictionary()
        self._swept: tuple[object, object] = (self.trust.ca, self.trust.crl)
        self._task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        await self.trust.start()
        await self.credentials.start()
        self._task = asyncio.create_task(self._sweep_loop(), name=f"{type(self).__name__}.sweep")

    async def _stop(self) -> None:
        await cancel_and_wait(self._task)
        await self.credentials.stop()
        await self.trust.stop()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self._swept == (self.trust.ca, self.trust.crl):
                continue
            try:
                self.sweep()
            except Exception:
                log.exception("closing the connections of revoked callers failed")

    def sweep(self) -> int:
        """Close every open connection whose client certificate the current CA and revocation list no longer
        accept (a revoked caller's idle keep-alive connections). Returns how many were closed."""
        self._swept = (self.trust.ca, self.trust.crl)
        closed = 0
        for transport, ssl_object in list(self._open.items()):
            if transport.is_closing() or self._current(ssl_object).error is None:
                continue
            transport.close()
            closed += 1
        if closed:
            log.info("closed %d connection(s) of callers no longer trusted", closed, extra=kv(event="tls_sweep"))
        return closed

    def load_crl(self, pem: bytes) -> bool:
        """Adopt a newer revocation list (etcd ``pki/crl``): every cached verdict is recomputed on its
        connection's next request, and open connections it revokes are closed now. ``PkiError`` if it does
        not verify; True if adopted."""
        if not self.trust.load_crl(pem):
            return False
        self.sweep()
        return True

    def _verify(self, ssl_object: object) -> _Verdict:
        ca, crl = self.trust.ca, self.trust.crl
        try:
            cert = peer_certificate(ssl_object)  # type: ignore[arg-type]  # an SSLObject, or None
            not_after = cert.not_valid_after_utc.timestamp()
            if crl is not None and crl.next_update is not None:  # an admitted caller is checked again then
                not_after = min(not_after, crl.next_update.timestamp())
            identity = self.trust.verify(cert, use="client", kinds=self.kinds)
        except (Unauthenticated, PermissionDenied) as exc:
            return _Verdict(None, exc, ca, crl, float("inf"))
        return _Verdict(identity, None, ca, crl, not_after)

    def identify(self, transport: asyncio.BaseTransport | None) -> Identity:
        """The verified identity, of any kind, of the caller on ``transport``; ``Unauthenticated`` if it
        proves none. The connection is remembered (for :meth:`sweep`) once admitted."""
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        if ssl_object is None:
            raise Unauthenticated("no TLS connection", reason="no_certificate")
        v = self._current(ssl_object)
        if v.error is not None:
            # a fresh exception each time: re-raising one instance would grow its traceback per request
            raise type(v.error)(v.error.message, **v.error.details)
        assert v.identity is not None and transport is not None
        self._open[transport] = ssl_object
        return v.identity

    def _current(self, ssl_object: object) -> _Verdict:
        """The cached verdict on a connection, recomputed when the CA or the list changed or it expired."""
        v = self._verdicts.get(ssl_object)
        if v is None or v.ca is not self.trust.ca or v.crl is not self.trust.crl or time.time() > v.not_after:
            v = self._verdicts[ssl_object] = self._verify(ssl_object)
        return v
