"""The PKI on disk, under ``$TIERMESH_HOME/pki/``::

    ca.pem  ca-key.pem(0600)  crl.pem  issued.jsonl
    tenants/T.pem  T-key.pem(0600)
    sites/S.pem  S-key.pem(0600)  S.curve(0600)
    admins/A.pem  A-key.pem(0600)
    schedulers/X.pem  X-key.pem(0600)
    stores/V.pem  V-key.pem(0600)
    etcd/E.pem  E-key.pem(0600)           etcd's own (server, peer, and the CRL follower's etcd client)

What one host of the mesh holds (a site's machine, the variant store's, a scheduler's) is
:meth:`PkiPaths.host_files`: the CA, the revocation list, and its own certificate, key and (a site) CURVE key
pair, nothing of any other identity. Peers' certificates reach it through etcd (``pki/sites/<site>``) and are
believed only when the CA vouches for them. The lab (``tiermesh up --netns``), the Kubernetes renderer
(``tiermesh.deploy``) and ``tiermesh pki bundle`` all take the list from there.

Every file is written whole and renamed into place (a reader never sees half a PEM), keys with mode 0600 from
their first byte. ``S.curve`` is ZeroMQ's ZPL certificate format (what ``zmq.auth.load_certificate`` reads):
the site's CURVE public and secret keys, Z85. ``issued.jsonl`` logs every certificate issued (serial, identity,
validity), one JSON object a line, so that revoking an identity can revoke all of its live certificates.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mesh.errors import PkiError
from mesh.pki.curve import CurveKeyPair
from mesh.pki.identity import Identity, Kind

if TYPE_CHECKING:  # imported by the functions that parse or write PEM: paths and CURVE files need none of it
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

__all__ = ["PRIVATE_FILES", "PkiPaths", "cert_pem", "curve_text", "key_pem", "read_cert", "read_curve", "read_key",
           "write_file"]

_DIRS: dict[Kind, str] = {"tenant": "tenants", "site": "sites", "admin": "admins", "scheduler": "schedulers",
                          "store": "stores", "etcd": "etcd"}
PRIVATE_FILES = ("key", "curve")  # the roles of host_files that are secrets (written 0600)


@dataclass(frozen=True, slots=True)
class PkiPaths:
    root: Path

    @classmethod
    def under(cls, home: Path | str) -> PkiPaths:
        return cls(Path(home) / "pki")

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca-key.pem"

    @property
    def crl(self) -> Path:
        return self.root / "crl.pem"

    @property
    def index(self) -> Path:
        return self.root / "issued.jsonl"

    def cert(self, identity: Identity) -> Path:
        return self.root / _DIRS[identity.kind] / f"{identity.name}.pem"

    def key(self, identity: Identity) -> Path:
        return self.root / _DIRS[identity.kind] / f"{identity.name}-key.pem"

    def curve(self, identity: Identity) -> Path:
        if identity.kind != "site":
            raise PkiError(f"only sites have CURVE keys, not {identity}")
        return self.root / _DIRS[identity.kind] / f"{identity.name}.curve"

    def host_files(self, identity: Identity) -> dict[str, Path]:
        """Everything the host of ``identity`` holds under this PKI root, by role: ``ca``, ``crl``, ``cert``,
        ``key`` and, for a site, ``curve``. Nothing else: no other identity's certificate or key."""
        files = {"ca": self.ca_cert, "crl": self.crl, "cert": self.cert(identity), "key": self.key(identity)}
        if identity.kind == "site":
            files["curve"] = self.curve(identity)
        return files


def write_file(path: Path, data: bytes, *, private: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync, rename); a private
    file is 0600 from the moment it exists, a public one 0644."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if not private:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise PkiError(f"{what} not found at {path} (run `tiermesh pki init` / `tiermesh pki issue`)") from exc
    except OSError as exc:
        raise PkiError(f"cannot read {what} {path}: {exc}") from exc


def read_cert(path: Path) -> x509.Certificate:
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificate(_read(path, "certificate"))
    except ValueError as exc:
        raise PkiError(f"{path} is not a PEM certificate: {exc}") from exc


def read_key(path: Path) -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        key = serialization.load_pem_private_key(_read(path, "private key"), password=None)
    except (ValueError, TypeError) as exc:
        raise PkiError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{path} is not an EC private key")
    return key


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def curve_text(identity: Identity, pair: CurveKeyPair) -> bytes:
    return (f"#   ZeroMQ CURVE **Secret** Certificate of {identity}\n"
            f"#   the public key is bound to {identity.name}.pem; keep this file secret (0600)\n"
            f"metadata\n    identity = \"{identity.uri}\"\n"
            f"curve\n    public-key = \"{pair.public.decode()}\"\n    secret-key = \"{pair.secret.decode()}\"\n"
            ).encode()


def read_curve(path: Path) -> CurveKeyPair:
    """The key pair in a ``.curve`` file; the public key is re-derived from the secret and must agree."""
    keys: dict[str, str] = {}
    for line in _read(path, "CURVE key file").decode("utf-8", "replace").splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name.strip() in ("public-key", "secret-key"):
            keys[name.strip()] = value.strip().strip('"')
    if "secret-key" not in keys:
        raise PkiError(f"{path} holds no CURVE secret-key")
    try:
        pair = CurveKeyPair.from_secret(keys["secret-key"])
    except Exception as exc:
        raise PkiError(f"{path}: bad CURVE secret key: {exc}") from exc
    if keys.get("public-key", pair.public.decode()) != pair.public.decode():
        raise PkiError(f"{path}: public-key does not match secret-key")
    return pair
