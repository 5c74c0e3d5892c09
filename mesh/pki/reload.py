"""Credentials that follow their files, for rotation without a restart.

:class:`ReloadingCredentials` builds ``ssl.SSLContext`` objects from an identity's certificate, key and the CA,
and when the certificate or key file changes (mtime, size or inode) loads the new pair into the *same*
context objects (``load_cert_chain``): servers and connection pools keep their context, new handshakes present
the new certificate, established connections are untouched. A half-rotated pair (a certificate whose key is not
written yet) is refused and retried on the next check, so the old pair stays in force meanwhile.

What a verifier trusts (the CA and the revocation list) follows its files the same way, on the
:class:`Poller` here: :class:`~mesh.pki.trust.TrustStore`.

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
from pathlib import Path
from typing import TYPE_CHECKING

from mesh.errors import ConfigError, PkiError
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv

if TYPE_CHECKING:
    from cryptography import x509

    from mesh.pki.files import PkiPaths
    from mesh.pki.identity import Identity

__all__ = ["Poller", "ReloadingCredentials", "Stamp", "client_tls", "file_stamp"]

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


class ReloadingCredentials(Poller):
    """An identity's TLS credentials (certificate, key, CA), re-read when the files change."""

    def __init__(self, cert: Path, key: Path, ca: Path, *, interval_s: float = 1.0) -> None:
        self.cert_path, self.key_path, self.ca_path = Path(cert), Path(key), Path(ca)
        self.interval_s = interval_s
        self._contexts: list[ssl.SSLContext] = []
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
        stamp = file_stamp(self.cert_path, self.key_path)
        if stamp == self._stamp:
            return False
        try:
            chain = self._read_pair()
        except PkiError as exc:  # mid-rotation or broken: keep the old pair, try again next time
            log.warning("new credentials not loaded yet", extra=kv(event="credentials_pending", reason=str(exc)))
            return False
        for ctx in self._contexts:
            self._load_into(ctx, chain)
        self._chain, self._stamp, self._certificate = chain, stamp, None
        reason = str(self.cert_path)
        if importlib.util.find_spec("cryptography") is not None:  # a server's log names the serial now in force
            reason += f" serial {self.certificate.serial_number:x}"
        log.info("credentials reloaded", extra=kv(event="credentials_reloaded", reason=reason))
        return True


def client_tls(base_url: str, cert: str | Path | None, key: str | Path | None, ca: str | Path | None,
               check_hostname: bool) -> tuple[ssl.SSLContext | None, ReloadingCredentials | None]:
    """An SDK client's SSL context for ``base_url`` (once per client) and the credentials that keep it
    current (None, None for plain http)."""
    https = base_url.lower().startswith("https://")
    if (cert is None) != (key is None):
        raise ConfigError("pass both cert= and key= (the client certificate and its private key), or neither")
    if cert is not None and not https:
        raise ConfigError(f"a client certificate needs an https:// URL, not {base_url!r}")
    if not https:
        return None, None
    if ca is None:
        raise ConfigError("an https:// mesh URL needs ca= (the mesh CA certificate, pki/ca.pem)")
    if cert is None or key is None:  # server authentication only: a mutual-TLS edge will refuse us
        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.check_hostname = check_hostname
        return ctx, None
    creds = ReloadingCredentials(Path(cert), Path(key), Path(ca))
    return creds.client_context(check_hostname=check_hostname), creds
