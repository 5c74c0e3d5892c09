"""What a verifier trusts, following its files: the CA certificate and the CA-signed revocation list.

:class:`TrustStore` re-reads them on change (on demand with ``refresh()``, and every ``interval_s`` when started as
a ``Service``, like :class:`~mesh.pki.reload.ReloadingCredentials`); ``verify`` is
:func:`mesh.pki.verify.verify_certificate` with them.

A list past its nextUpdate is still *held* (read from the file, or adopted from etcd when newer: a newer list never
names fewer revocations), so a host restarted with a stale ``crl.pem`` starts, and takes the fresh list etcd
delivers moments later; until one arrives ``verify`` refuses everyone (``crl_expired``), and the poll logs an error
every :data:`EXPIRED_LOG_S` saying so.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path

from cryptography import x509

from mesh.errors import PkiError
from mesh.log import get_logger, kv
from mesh.pki.crl import RevocationList
from mesh.pki.files import PkiPaths, read_cert
from mesh.pki.identity import KINDS, Identity, Kind
from mesh.pki.policy import Use
from mesh.pki.reload import Poller, Stamp, file_stamp
from mesh.pki.verify import verify_certificate

__all__ = ["EXPIRED_LOG_S", "TrustStore"]

log = get_logger(__name__)
EXPIRED_LOG_S = 60.0  # how often a verifier holding an expired list says so (its refusals are logged by their callers)


class TrustStore(Poller):
    """The CA certificate and revocation list a verifier trusts, re-read when their files change. A new
    revocation list that does not verify is refused (logged) and the previous one stays in force."""

    def __init__(self, ca: Path, crl: Path | None, *, interval_s: float = 1.0) -> None:
        self.ca_path, self.crl_path = Path(ca), (Path(crl) if crl is not None else None)
        self.interval_s = interval_s
        self.ca = read_cert(self.ca_path)
        self.crl = self._read_crl() if self.crl_path is not None else None
        self._stamp = self._now_stamp()
        self._expired_logged = -EXPIRED_LOG_S

    @classmethod
    def under(cls, paths: PkiPaths, *, interval_s: float = 1.0) -> TrustStore:
        return cls(paths.ca_cert, paths.crl, interval_s=interval_s)

    def _now_stamp(self) -> Stamp:
        return file_stamp(self.ca_path, *([self.crl_path] if self.crl_path else []))

    def _read_crl(self) -> RevocationList:
        assert self.crl_path is not None
        try:
            pem = self.crl_path.read_bytes()
        except OSError as exc:
            raise PkiError(f"cannot read the revocation list {self.crl_path}: {exc}") from exc
        return RevocationList.load(pem, self.ca, allow_expired=True)

    def _say_if_expired(self) -> None:
        crl, now = self.crl, time.monotonic()
        if crl is None or not crl.expired() or now - self._expired_logged < EXPIRED_LOG_S:
            return
        self._expired_logged = now
        log.error("the revocation list held (number %d) expired at %s: every peer is refused until a fresh one "
                  "arrives (re-sign it with `tiermesh pki refresh-crl`)", crl.number, crl.next_update,
                  extra=kv(event="crl_expired", reason=str(self.crl_path)))

    def refresh(self) -> bool:
        self._say_if_expired()
        stamp = self._now_stamp()
        if stamp == self._stamp:
            return False
        try:
            ca = read_cert(self.ca_path)
            previous, self.ca = self.ca, ca
            try:
                crl = self._read_crl() if self.crl_path is not None else None
            except PkiError:
                self.ca = previous
                raise
        except PkiError as exc:
            log.warning("trust material not reloaded", extra=kv(event="trust_pending", reason=str(exc)))
            return False
        if (crl is not None and self.crl is not None and ca == previous and crl.number < self.crl.number):
            crl = self.crl  # the file is older than a list adopted from etcd: keep the newer one
        self.crl, self._stamp = crl, stamp
        return True

    def load_crl(self, pem: bytes) -> bool:
        """Adopt a revocation list received from elsewhere (etcd ``pki/crl``) if it verifies and is newer
        than the one held (expired or not: see the module). True if adopted."""
        crl = RevocationList.load(pem, self.ca, allow_expired=True)
        if self.crl is not None and crl.number <= self.crl.number:
            return False
        self.crl = crl
        return True

    def verify(self, cert: bytes | x509.Certificate, *, use: Use, kinds: Collection[Kind] = KINDS,
               curve_public: bytes | str | None = None) -> Identity:
        return verify_certificate(cert, ca=self.ca, crl=self.crl, use=use, kinds=kinds, curve_public=curve_public)
