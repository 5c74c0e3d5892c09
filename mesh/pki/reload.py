"""Credentials that follow their files, for rotation without a restart.

:class:`ReloadingCredentials` builds ``ssl.SSLContext`` objects from an identity's certificate, key and the CA,
and when the certificate or key file changes (mtime, size or inode) loads the new pair into the *same*
context objects (``load_cert_chain``): servers and connection pools keep their context, new handshakes present
the new certificate, established connections are untouched. A half-rotated pair (a certificate whose key is not
written yet) is refused and retried on the next check, so the old pair stays in force meanwhile.

What a verifier trusts (the CA and the revocation list) follows its files the same way, on the
:class:`Poller` here: :class:`~mesh.pki.trust.TrustStore`.

A *client* checks the server's revocation too, with ``ssl`` alone: :class:`CrlFile` loads the CA's PEM revocation
list into its client contexts with ``VERIFY_CRL_CHECK_LEAF``, so OpenSSL refuses, at the handshake and before a
request is sent, a server certificate the list names (a revoked site key impersonating an edge), a list not signed
by the CA, and a list past its nextUpdate (fail closed, as every verifier of the mesh: :mod:`mesh.pki.crl`). A
context cannot drop a list once loaded, and of two lists of one CA OpenSSL uses the one with the later lastUpdate,
a time in whole seconds: a list re-signed within the second of the one before would lose to it. So a changed list
is loaded into the contexts made before (enough after a second) *and* a client builds a fresh context for its next
connections (:func:`client_tls` hands out a factory; the SDK's transport opens a new pool with it on a change).

This module needs only the standard library (``ssl``): the SDK on a device builds its mutual-TLS context with it,
and the base install has no ``cryptography``; the parsed certificate (:attr:`ReloadingCredentials.certificate`) is
read only where it is asked for.

Both check on demand (``refresh()``, a few ``stat`` calls) and, when started as a ``Service``, every
``interval_s`` in the background.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import ssl
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mesh.errors import ConfigError, PkiError
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv

if TYPE_CHECKING:
    from cryptography import x509

    from mesh.pki.files import PkiPaths
    from mesh.pki.identity import Identity

__all__ = ["ContextFactory", "CrlFile", "Poller", "ReloadingCredentials", "Stamp", "client_tls", "file_stamp"]

log = get_logger(__name__)
Stamp = tuple[tuple[int, int, int] | None, ...]


def file_stamp(*paths: Path) -> Stamp:
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


def _load_pem_file(ctx: ssl.SSLContext, data: bytes, what: str) -> None:
    """``ctx.load_verify_locations`` of ``data`` (it reads only files: an anonymous in-memory one, so what is
    loaded is exactly what was checked); ``PkiError`` if OpenSSL refuses it."""
    fd = os.memfd_create("tiermesh-verify", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        ctx.load_verify_locations(cafile=f"/proc/self/fd/{fd}")
    except (ssl.SSLError, OSError) as exc:
        raise PkiError(f"cannot load {what}: {exc}") from exc
    finally:
        os.close(fd)


_CRL_BEGIN = b"-----BEGIN X509 CRL-----"


class CrlFile(Poller):
    """The CA's revocation list (PEM) that client contexts check the server's certificate against, re-read when the
    file changes. The file must hold revocation lists and nothing else: a certificate in it would be loaded as one
    more trusted CA (``load_verify_locations`` reads both), so anything else is refused (``PkiError``)."""

    def __init__(self, path: Path, *, interval_s: float = 1.0) -> None:
        self.path, self.interval_s = Path(path), interval_s
        self._contexts: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()  # a context no one holds is let go
        self._pem = self._read()  # fails loudly at construction: a client told to check revocation must
        self._stamp = file_stamp(self.path)

    def _read(self) -> bytes:
        try:
            pem = self.path.read_bytes()
        except OSError as exc:
            raise PkiError(f"cannot read the revocation list {self.path}: {exc}") from exc
        blocks = [line.strip() for line in pem.splitlines() if line.startswith(b"-----BEGIN ")]
        if not blocks or any(b != _CRL_BEGIN for b in blocks):
            raise PkiError(f"{self.path} is not a PEM revocation list (X509 CRL blocks only)")
        _load_pem_file(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), pem, f"the revocation list {self.path}")
        return pem

    def apply(self, ctx: ssl.SSLContext) -> ssl.SSLContext:
        """Make ``ctx`` check the leaf certificate of every server it meets against the list (kept current)."""
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        _load_pem_file(ctx, self._pem, f"the revocation list {self.path}")
        self._contexts.add(ctx)
        return ctx

    def refresh(self) -> bool:
        """Load a changed list into every context. True if it did."""
        stamp = file_stamp(self.path)
        if stamp == self._stamp:
            return False
        try:
            pem = self._read()
        except PkiError as exc:  # broken or missing: the list loaded before stays in force
            log.warning("revocation list not reloaded", extra=kv(event="crl_pending", reason=str(exc)))
            return False
        for ctx in list(self._contexts):
            _load_pem_file(ctx, pem, f"the revocation list {self.path}")
        self._pem, self._stamp = pem, stamp
        log.info("revocation list reloaded", extra=kv(event="crl_reloaded", reason=str(self.path)))
        return True


class ReloadingCredentials(Poller):
    """An identity's TLS credentials (certificate, key, CA), re-read when the files change. With ``crl`` (the CA's
    PEM revocation list), client contexts also refuse a server whose certificate it names (:class:`CrlFile`)."""

    def __init__(self, cert: Path, key: Path, ca: Path, *, interval_s: float = 1.0, crl: Path | None = None) -> None:
        self.cert_path, self.key_path, self.ca_path = Path(cert), Path(key), Path(ca)
        self.interval_s = interval_s
        self.crl = CrlFile(crl, interval_s=interval_s) if crl is not None else None
        self._contexts: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()  # a context no one holds is let go
        self._stamp: Stamp = ()
        self._chain = self._read_pair()  # fails loudly at construction: no credentials, no service
        self._stamp = file_stamp(self.cert_path, self.key_path)
        self._certificate: x509.Certificate | None = None

    @property
    def certificate(self) -> x509.Certificate:
        """The certificate in force, parsed (with ``cryptography``) on first use after each load."""
        if self._certificate is None:
            from cryptography import x509  # not on the SDK's path: see the module docstring

            self._certificate = x509.load_pem_x509_certificate(self._chain)
        return self._certificate

    @classmethod
    def for_identity(cls, paths: PkiPaths, identity: Identity, *, interval_s: float = 1.0,
                     check_crl: bool = False) -> ReloadingCredentials:
        """``identity``'s files under ``paths``; ``check_crl``: its client contexts check servers against
        ``paths.crl``."""
        return cls(paths.cert(identity), paths.key(identity), paths.ca_cert, interval_s=interval_s,
                   crl=paths.crl if check_crl else None)

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
        self._contexts.add(ctx)
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
        return self.crl.apply(ctx) if self.crl is not None else ctx

    def refresh(self) -> bool:
        """Load a changed certificate/key pair (and revocation list) into every context made here. True if it did."""
        crl_changed = self.crl.refresh() if self.crl is not None else False
        return self._refresh_pair() or crl_changed

    def _refresh_pair(self) -> bool:
        stamp = file_stamp(self.cert_path, self.key_path)
        if stamp == self._stamp:
            return False
        try:
            chain = self._read_pair()
        except PkiError as exc:  # mid-rotation or broken: keep the old pair, try again next time
            log.warning("new credentials not loaded yet", extra=kv(event="credentials_pending", reason=str(exc)))
            return False
        for ctx in list(self._contexts):
            self._load_into(ctx, chain)
        self._chain, self._stamp, self._certificate = chain, stamp, None
        reason = str(self.cert_path)
        if importlib.util.find_spec("cryptography") is not None:  # a server's log names the serial now in force
            reason += f" serial {self.certificate.serial_number:x}"
        log.info("credentials reloaded", extra=kv(event="credentials_reloaded", reason=reason))
        return True


ContextFactory = Callable[[], ssl.SSLContext]


def client_tls(base_url: str, cert: str | Path | None, key: str | Path | None, ca: str | Path | None,
               check_hostname: bool, crl: str | Path | None = None,
               ) -> tuple[ContextFactory | None, ReloadingCredentials | CrlFile | None]:
    """An SDK client's SSL contexts for ``base_url``: a factory of client contexts from the files in force (called
    for each connection pool; None for plain http), and what checks those files (``refresh()``, True on a change):
    the credentials (with their revocation list), the list alone (no client certificate), or None.
    ``crl``: the CA's revocation list (``pki/crl.pem``): the server's certificate is checked against it. A
    ``grpcs://`` URL is TLS as ``https://`` is (its transport adds ALPN ``h2`` to each context it gets)."""
    https = base_url.lower().startswith(("https://", "grpcs://"))
    if (cert is None) != (key is None):
        raise ConfigError("pass both cert= and key= (the client certificate and its private key), or neither")
    if (cert is not None or crl is not None) and not https:
        raise ConfigError(f"a client certificate or crl= needs an https:// or grpcs:// URL, not {base_url!r}")
    if not https:
        return None, None
    if ca is None:
        raise ConfigError(f"a TLS mesh URL ({base_url}) needs ca= (the mesh CA certificate, pki/ca.pem)")
    if cert is None or key is None:  # server authentication only: a mutual-TLS edge will refuse us
        crl_file = CrlFile(Path(crl)) if crl is not None else None

        def server_only() -> ssl.SSLContext:
            ctx = ssl.create_default_context(cafile=str(ca))
            ctx.check_hostname = check_hostname
            return crl_file.apply(ctx) if crl_file is not None else ctx

        server_only()  # fails now, not at the first request, when the CA cannot be read
        return server_only, crl_file
    creds = ReloadingCredentials(Path(cert), Path(key), Path(ca), crl=Path(crl) if crl is not None else None)
    creds.client_context(check_hostname=check_hostname)
    return lambda: creds.client_context(check_hostname=check_hostname), creds
