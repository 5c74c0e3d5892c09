"""The CA's operations on a home directory: what ``tiermesh pki`` (and later ``tiermesh up``) runs.

``init`` makes the CA and an empty revocation list; ``renew`` keeps an identity's certificate while it is good for a
while yet (:data:`~mesh.pki.policy.KEEP_FRACTION`) and issues it otherwise; ``issue`` writes an identity's
certificate and key (and a site's CURVE key pair, bound into its certificate), replacing the previous ones in place
so that running processes pick them up (:class:`mesh.pki.reload.ReloadingCredentials`); ``revoke`` puts every live
certificate of an identity on ``crl.pem`` (``tiermesh pki revoke`` then publishes it through etcd ``pki/crl``;
``adopt_crl`` takes a newer list from there first, so two operators' homes never fork the numbering);
``refresh_crl`` re-signs the list before its nextUpdate (verifiers refuse everyone once the list they hold is past it);
``listing`` reads the issuance log against the list; ``bundle`` copies what one host needs (and nothing else) into
that host's own PKI directory.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import BestAvailableEncryption, pkcs12

from mesh.errors import ConfigError, MeshError, PkiError
from mesh.pki.ca import CertificateAuthority, IssuedCertificate, san_for_address
from mesh.pki.crl import REASONS, Revocation, RevocationList
from mesh.pki.curve import CurveKeyPair, curve_key_from_certificate, raw_curve_key
from mesh.pki.files import (
    PRIVATE_FILES,
    PkiPaths,
    cert_pem,
    curve_text,
    key_pem,
    read_cert,
    read_curve,
    read_key,
    write_file,
)
from mesh.pki.identity import Identity
from mesh.pki.policy import CA_LIFETIME, EKUS, KEEP_FRACTION
from mesh.pki.verify import verify_certificate

__all__ = ["IssuedRecord", "LocalPki"]


@dataclass(frozen=True, slots=True)
class IssuedRecord:
    """One line of ``issued.jsonl``, with whether the current revocation list names it."""

    identity: Identity
    serial: int
    not_before: datetime
    not_after: datetime
    revoked: bool = False

    def to_json(self) -> str:
        return json.dumps({"identity": self.identity.uri, "serial": f"{self.serial:x}",
                           "not_before": self.not_before.isoformat(), "not_after": self.not_after.isoformat()})

    @classmethod
    def from_json(cls, line: str) -> IssuedRecord:
        d = json.loads(line)
        return cls(Identity.from_uri(d["identity"]), int(d["serial"], 16), datetime.fromisoformat(d["not_before"]),
                   datetime.fromisoformat(d["not_after"]))


@dataclass(frozen=True, slots=True)
class LocalPki:
    paths: PkiPaths

    @classmethod
    def under(cls, home: Path | str) -> LocalPki:
        return cls(PkiPaths.under(home))

    def exists(self) -> bool:
        return self.paths.ca_cert.exists() or self.paths.ca_key.exists()

    def init(self, *, force: bool = False, lifetime: timedelta = CA_LIFETIME) -> CertificateAuthority:
        """A new CA and an empty revocation list. Refuses to replace an existing CA unless ``force`` (which
        invalidates every certificate it issued: they must all be issued again)."""
        if self.exists() and not force:
            raise ConfigError(f"a CA already exists in {self.paths.root}: pass --force to replace it "
                              f"(every certificate it issued stops being valid)")
        ca = CertificateAuthority.create(lifetime=lifetime)
        write_file(self.paths.ca_key, key_pem(ca.key), private=True)
        write_file(self.paths.ca_cert, cert_pem(ca.cert))
        write_file(self.paths.crl, RevocationList.empty(ca).to_pem())
        write_file(self.paths.index, b"")
        return ca

    def ca(self) -> CertificateAuthority:
        ca = CertificateAuthority(read_cert(self.paths.ca_cert), read_key(self.paths.ca_key))
        if ca.cert.public_key() != ca.key.public_key():
            raise PkiError(f"{self.paths.ca_key} is not the key of {self.paths.ca_cert}")
        return ca

    def crl(self) -> RevocationList:
        try:
            pem = self.paths.crl.read_bytes()
        except OSError as exc:
            raise PkiError(f"cannot read the revocation list {self.paths.crl}: {exc}") from exc
        # the CA's own list, expired or not: the holder of the CA re-signs it (refresh_crl), never refuses it
        return RevocationList.load(pem, read_cert(self.paths.ca_cert),
                                   names={r.serial: r.identity for r in self._records()}, allow_expired=True)

    def standardise_crl(self) -> bool:
        """Re-sign ``crl.pem`` (number + 1, same entries) if it was written with tiermesh's private entry extension,
        which etcd's parser refuses (:mod:`mesh.pki.crl`): an etcd given such a list refuses every client. True if
        it was re-signed."""
        from mesh.pki.policy import REVOKED_IDENTITY_OID

        crl = self.crl()
        if not any(ext.oid == REVOKED_IDENTITY_OID for entry in crl.crl for ext in entry.extensions):
            return False
        updated = crl.add(self.ca(), [], expiry={r.serial: r.not_after for r in self._records()})
        write_file(self.paths.crl, updated.to_pem())
        return True

    def refresh_crl(self, *, now: datetime | None = None) -> RevocationList:
        """Re-sign ``crl.pem``: the same revocations (less those whose certificate has expired), number + 1, fresh
        for :data:`~mesh.pki.policy.CRL_LIFETIME` from ``now``. Verifiers refuse everyone once the list they hold
        is past nextUpdate, so the CA's holder runs this every :data:`~mesh.pki.policy.CRL_REFRESH`
        (``tiermesh pki refresh-crl``; ``tiermesh up`` on its own)."""
        updated = self.crl().add(self.ca(), [], now=now, expiry={r.serial: r.not_after for r in self._records()})
        write_file(self.paths.crl, updated.to_pem())
        return updated

    def adopt_crl(self, pem: bytes) -> bool:
        """Replace ``crl.pem`` with ``pem`` if it is a list signed by this CA and newer than the one here.
        ``PkiError`` if it does not verify. True if adopted."""
        crl = RevocationList.load(pem, read_cert(self.paths.ca_cert), allow_expired=True)
        if crl.number <= self.crl().number:
            return False
        write_file(self.paths.crl, crl.to_pem())
        return True

    def issue(self, identity: Identity, *, lifetime: timedelta | None = None,
              addresses: Sequence[str] = ()) -> IssuedCertificate:
        """Issue (or re-issue: rotation) ``identity``'s certificate and write it with its key; a site also
        gets a fresh CURVE key pair bound into the certificate. Files are replaced key first, then the
        certificate, so a reader that sees the new certificate finds its key already there."""
        ca = self.ca()
        curve = CurveKeyPair.generate() if identity.kind == "site" else None
        issued = ca.issue(identity, lifetime=lifetime, addresses=addresses,
                          curve_public=curve.public if curve else None)
        if curve is not None:
            write_file(self.paths.curve(identity), curve_text(identity, curve), private=True)
        write_file(self.paths.key(identity), key_pem(issued.key), private=True)
        write_file(self.paths.cert(identity), cert_pem(issued.cert))
        record = IssuedRecord(identity, issued.serial, issued.cert.not_valid_before_utc,
                              issued.cert.not_valid_after_utc)
        with open(self.paths.index, "a", encoding="utf-8") as f:
            f.write(record.to_json() + "\n")
        return issued

    def renew(self, identity: Identity, *, addresses: Sequence[str] = (), force: bool = False,
              now: datetime | None = None) -> bool:
        """Issue ``identity``'s certificate unless the one on disk may be kept: whole (certificate, its key, a site's
        CURVE key pair, the one it binds), of this CA, not revoked, naming exactly ``addresses`` and with more than
        :data:`~mesh.pki.policy.KEEP_FRACTION` of its lifetime left. ``force``: issue it anyway (rotation). True if
        it issued one."""
        if not force and self._keeps(identity, addresses, now or datetime.now(UTC)):
            return False
        self.issue(identity, addresses=addresses)
        return True

    def _keeps(self, identity: Identity, addresses: Sequence[str], now: datetime) -> bool:
        try:
            cert = read_cert(self.paths.cert(identity))
            if read_key(self.paths.key(identity)).public_key() != cert.public_key():
                return False
            if identity.kind == "site":
                bound = curve_key_from_certificate(cert)
                if bound is None or raw_curve_key(bound) != raw_curve_key(self.curve(identity).public):
                    return False
            # the list's freshness is not this certificate's business: revocation is checked on its own below
            if verify_certificate(cert, ca=read_cert(self.paths.ca_cert), crl=None, use=EKUS[identity.kind][0],
                                  kinds=(identity.kind,), now=now) != identity:
                return False
        except MeshError:  # missing or unreadable files, another CA, expired: issue a new one
            return False
        if self.crl().is_revoked(cert.serial_number):
            return False
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        named = {n for n in san if not isinstance(n, x509.UniformResourceIdentifier)}
        if named != {san_for_address(a) for a in addresses}:
            return False
        life = cert.not_valid_after_utc - cert.not_valid_before_utc
        return cert.not_valid_after_utc - now > life * KEEP_FRACTION

    def curve(self, identity: Identity) -> CurveKeyPair:
        return read_curve(self.paths.curve(identity))

    def _records(self) -> list[IssuedRecord]:
        try:
            lines = self.paths.index.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        try:
            return [IssuedRecord.from_json(line) for line in lines if line.strip()]
        except (ValueError, KeyError, ConfigError) as exc:
            raise PkiError(f"{self.paths.index} is damaged: {exc}") from exc

    def revoke(self, identity: Identity, *, reason: str | None = None,
               now: datetime | None = None) -> tuple[RevocationList, list[int]]:
        """Put every unexpired certificate of ``identity`` (from the issuance log, and the one on disk) on the
        revocation list and rewrite ``crl.pem``. Returns the new list and the serials newly revoked."""
        if reason is not None and reason not in REASONS:
            raise ConfigError(f"unknown revocation reason {reason!r}: one of {', '.join(REASONS)}")
        now = now or datetime.now(UTC)
        ca, crl = self.ca(), self.crl()
        records = self._records()
        live = {r.serial: r.not_after for r in records if r.identity == identity and r.not_after > now}
        if self.paths.cert(identity).exists():
            cert = read_cert(self.paths.cert(identity))
            if cert.not_valid_after_utc > now:
                live[cert.serial_number] = cert.not_valid_after_utc
        new = [s for s in live if not crl.is_revoked(s)]
        if not live:
            raise ConfigError(f"{identity} has no unexpired certificate to revoke")
        expiry = {r.serial: r.not_after for r in records}
        updated = crl.add(ca, [Revocation(s, identity, now, reason, live[s]) for s in new], now=now, expiry=expiry)
        write_file(self.paths.crl, updated.to_pem())
        return updated, new

    def listing(self) -> list[IssuedRecord]:
        """Every certificate issued (oldest first) with its revocation state."""
        crl = self.crl()
        return [IssuedRecord(r.identity, r.serial, r.not_before, r.not_after, crl.is_revoked(r.serial))
                for r in self._records()]

    def bundle(self, identity: Identity, dest: PkiPaths) -> dict[str, Path]:
        """Copy exactly the files the host of ``identity`` holds (:meth:`PkiPaths.host_files`: the CA, the
        revocation list, its certificate, key and a site's CURVE keys) into ``dest``, in the layout the host reads
        them from; secrets 0600. Refuses an identity whose certificate this CA does not vouch for (missing,
        revoked, expired): a host must not start with credentials every peer refuses. Returns role -> path."""
        src = self.paths.host_files(identity)
        if not src["cert"].exists():
            raise ConfigError(f"no certificate for {identity} in {self.paths.root}: issue it first "
                              f"(`tiermesh pki issue --{identity.kind} {identity.name}`)")
        try:
            verify_certificate(read_cert(src["cert"]), ca=self.ca().cert, crl=self.crl(), use="client",
                               kinds=(identity.kind,))
        except MeshError as exc:
            raise ConfigError(f"{identity}'s certificate is not valid ({exc}): issue it again before bundling "
                              f"it") from exc
        out: dict[str, Path] = {}
        for role, path in dest.host_files(identity).items():
            try:
                data = src[role].read_bytes()
            except OSError as exc:
                raise PkiError(f"cannot read {src[role]} ({role} of {identity}): {exc}") from exc
            write_file(path, data, private=role in PRIVATE_FILES)
            out[role] = path
        return out

    def certificate(self, identity: Identity) -> x509.Certificate:
        return read_cert(self.paths.cert(identity))

    def export_pkcs12(self, identity: Identity, password: str) -> Path:
        """``identity``'s certificate, key and the CA as one password-protected PKCS#12 file beside its PEM
        files (``<name>.p12``, 0600): what a browser imports to present an admin certificate."""
        if not password:
            raise ConfigError("a PKCS#12 export needs a password (browsers refuse empty ones)")
        blob = pkcs12.serialize_key_and_certificates(
            identity.common_name.encode(), read_key(self.paths.key(identity)), read_cert(self.paths.cert(identity)),
            [read_cert(self.paths.ca_cert)], BestAvailableEncryption(password.encode()))
        path = self.paths.cert(identity).with_suffix(".p12")
        write_file(path, blob, private=True)
        return path
