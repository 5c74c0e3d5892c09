"""Credentials that follow their files, for rotation and revocation without a restart.

:class:`ReloadingCredentials` builds ``ssl.SSLContext`` objects from an identity's certificate, key and the CA,
and when the certificate or key file changes (mtime, size or inode) loads the new pair into the *same*
context objects (``load_cert_chain``): servers and connection pools keep their context, new handshakes present
the new certificate, established connections are untouched. A half-rotated pair (a certificate whose key is not
written yet) is refused and retried on the next check, so the old pair stays in force meanwhile.

:class:`TrustStore` holds what a verifier trusts (the CA certificate and the CA-signed revocation list) and
re-reads them on change; ``verify`` is :func:`mesh.pki.verify.verify_certificate` with them.

Both check on demand (``refresh()``, a few ``stat`` calls) and, when started as a ``Service``, every
``interval_s`` in the background.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Collection
from pathlib import Path

from cryptography import x509

from mesh.errors import PkiError
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from mesh.pki.crl import RevocationList
from mesh.pki.files import PkiPaths, read_cert
from mesh.pki.identity import KINDS, Identity, Kind
from mesh.pki.policy import Use
from mesh.pki.verify import verify_certificate

__all__ = ["Poller", "ReloadingCredentials", "TrustStore"]

log = get_logger(__name__)
_Stamp = tuple[tuple[int, int, int] | None, ...]


def _stamp(*paths: Path) -> _Stamp:
    out: list[tuple[int, int, int] | None] = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class Poller(Service):
    """Calls ``refresh()`` every ``interval_s`` while running; a failing refresh is logged, never fatal."""

    interval_s: float
    _task: asyncio.Task[None] | None = None

    def refresh(self) -> bool:
        raise NotImplementedError

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.refresh()
            except Exception:
                log.exception("reloading credentials failed; the previous ones stay in force")

    async def _start(self) -> None:
        self._task = asyncio.create_task(self._poll(), name=f"{type(self).__name__}.poll")

    async def _stop(self) -> None:
        await cancel_and_wait(self._task)


class ReloadingCredentials(Poller):
    """An identity's TLS credentials (certificate, key, CA), re-read when the files change."""

    def __init__(self, cert: Path, key: Path, ca: Path, *, interval_s: float = 1.0) -> None:
        self.cert_path, self.key_path, self.ca_path = Path(cert), Path(key), Path(ca)
        self.interval_s = interval_s
        self._contexts: list[ssl.SSLContext] = []
        self._stamp: _Stamp = ()
        self._chain = self._read_pair()  # fails loudly at construction: no credentials, no service
        self._stamp = _stamp(self.cert_path, self.key_path)
        self.certificate = x509.load_pem_x509_certificate(self._chain)

    @classmethod
    def for_identity(cls, paths: PkiPaths, identity: Identity, *, interval_s: float = 1.0) -> ReloadingCredentials:
        return cls(paths.cert(identity), paths.key(identity), paths.ca_cert, interval_s=interval_s)

    def _read_pair(self) -> bytes:
        try:
            chain = self.cert_path.read_bytes() + b"\n" + self.key_path.read_bytes()
        except OSError as exc:
            raise PkiError(f"cannot read credentials {self.cert_path} / {self.key_path}: {exc}") from exc
        self._load_into(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), chain)  # checks that the key fits
        return chain

    @staticmethod
    def _load_into(ctx: ssl.SSLContext, chain: bytes) -> None:
        # load_cert_chain reads only files: give it the checked bytes through an anonymous in-memory file, so
        # that what is loaded is exactly what was checked, and the key never touches another disk file.
        fd = os.memfd_create("tiermesh-credentials", os.MFD_CLOEXEC)
        try:
            os.write(fd, chain)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        except (ssl.SSLError, OSError) as exc:
            raise PkiError(f"certificate and key do not form a usable pair: {exc}") from exc
        finally:
            os.close(fd)

    def _context(self, purpose: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_verify_locations(cafile=str(self.ca_path))
        except (ssl.SSLError, OSError) as exc:
            raise PkiError(f"cannot load the CA {self.ca_path}: {exc}") from exc
        self._load_into(ctx, self._chain)
        self._contexts.append(ctx)
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """Mutual TLS server: a peer without a certificate from our CA fails the handshake (on TLS 1.3: at
        its first read). Identity, EKU and revocation are checked after it with a ``TrustStore``."""
        return self._context(ssl.PROTOCOL_TLS_SERVER)

    def client_context(self, *, check_hostname: bool = False) -> ssl.SSLContext:
        """Mutual TLS client. Host names are not checked by default: a site is known by its URI SAN, which
        the caller checks on ``peer_certificate`` with a ``TrustStore``."""
        ctx = self._context(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = check_hostname
        return ctx

    def refresh(self) -> bool:
        """Load a changed certificate/key pair into every context made here. True if it did."""
        stamp = _stamp(self.cert_path, self.key_path)
        if stamp == self._stamp:
            return False
        try:
            chain = self._read_pair()
        except PkiError as exc:  # mid-rotation or broken: keep the old pair, try again next time
            log.warning("new credentials not loaded yet", extra=kv(event="credentials_pending", reason=str(exc)))
            return False
        for ctx in self._contexts:
            self._load_into(ctx, chain)
        self._chain, self._stamp = chain, stamp
        self.certificate = x509.load_pem_x509_certificate(chain)
        log.info("credentials reloaded", extra=kv(event="credentials_reloaded",
                                                  reason=f"{self.cert_path} serial {self.certificate.serial_number:x}"))
        return True


class TrustStore(Poller):
    """The CA certificate and revocation list a verifier trusts, re-read when their files change. A new
    revocation list that does not verify is refused (logged) and the previous one stays in force."""

    def __init__(self, ca: Path, crl: Path | None, *, interval_s: float = 1.0) -> None:
        self.ca_path, self.crl_path = Path(ca), (Path(crl) if crl is not None else None)
        self.interval_s = interval_s
        self.ca = read_cert(self.ca_path)
        self.crl = self._read_crl() if self.crl_path is not None else None
        self._stamp = self._now_stamp()

    @classmethod
    def under(cls, paths: PkiPaths, *, interval_s: float = 1.0) -> TrustStore:
        return cls(paths.ca_cert, paths.crl, interval_s=interval_s)

    def _now_stamp(self) -> _Stamp:
        return _stamp(self.ca_path, *([self.crl_path] if self.crl_path else []))

    def _read_crl(self) -> RevocationList:
        assert self.crl_path is not None
        try:
            pem = self.crl_path.read_bytes()
        except OSError as exc:
            raise PkiError(f"cannot read the revocation list {self.crl_path}: {exc}") from exc
        return RevocationList.load(pem, self.ca)

    def refresh(self) -> bool:
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
        than the one held. True if adopted."""
        crl = RevocationList.load(pem, self.ca)
        if self.crl is not None and crl.number <= self.crl.number:
            return False
        self.crl = crl
        return True

    def verify(self, cert: bytes | x509.Certificate, *, use: Use, kinds: Collection[Kind] = KINDS,
               curve_public: bytes | str | None = None) -> Identity:
        return verify_certificate(cert, ca=self.ca, crl=self.crl, use=use, kinds=kinds, curve_public=curve_public)
