"""The revocation list: which certificates the CA has withdrawn before they expire.

An X.509 CRL signed by the mesh CA, one entry per revoked serial (with its reason), and nothing a standard parser
cannot read: etcd reads this very file (``--client-crl-file``), and Go's parser refuses a list with an entry
extension under tiermesh's private OID arc ("asn1: base 128 integer too large"), which made etcd refuse *every*
client once one certificate was revoked (measured on etcd 3.5.1). Who each serial belonged to is kept beside the
list instead: the CA's issuance log, and ``identities`` in the etcd record (for people and logs; the serial alone
decides). Lists written before carried the identity as a private entry extension
(:data:`mesh.pki.policy.REVOKED_IDENTITY_OID`); it is still read. A ``CRLNumber`` grows by one with every new list,
so a reader holding several copies (the file, etcd ``pki/crl``) keeps the highest. Entries are dropped once the
certificate they name has expired (it is refused anyway).

Freshness: a list's nextUpdate is :data:`~mesh.pki.policy.CRL_LIFETIME` (two days) after it is signed, never past
the CA's notAfter, and the CA's holder re-signs it (same entries, number + 1) every
:data:`~mesh.pki.policy.CRL_REFRESH`: ``tiermesh pki refresh-crl``, and ``tiermesh up`` on its own. Holding and
using are two things. A holder *adopts* any list of its CA with a higher number, expired or not (a newer list names
every revocation an older one does, so it is never worse), and :meth:`RevocationList.load` takes
``allow_expired=True`` for that. A verifier *uses* only a fresh one: :func:`mesh.pki.verify.verify_certificate`
refuses every certificate (``crl_expired``) while the list it holds is past nextUpdate, as it would an expired
certificate: fail closed, and loudly (each refusal names the fix), because a list nobody re-signed for two days may
be missing revocations.

In etcd (``pki/crl``) the list travels as :func:`crl_record`: ``{"schema": 1, "number": N, "pem": "...",
"identities": {serial hex: identity URI}}``; the number and identities are there for people and guards, readers
trust only the signed PEM (:func:`crl_pem_from_record`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from mesh.errors import ConfigError, PkiError
from mesh.pki.ca import CertificateAuthority
from mesh.pki.identity import Identity
from mesh.pki.policy import CLOCK_SKEW, CRL_LIFETIME, REVOKED_IDENTITY_OID

__all__ = ["CRL_RECORD_SCHEMA", "REASONS", "Revocation", "RevocationList", "crl_pem_from_record", "crl_record"]

CRL_RECORD_SCHEMA = 1
REASONS: tuple[str, ...] = tuple(r.name for r in x509.ReasonFlags if r is not x509.ReasonFlags.remove_from_crl)


@dataclass(frozen=True, slots=True)
class Revocation:
    serial: int
    identity: Identity | None
    revoked_at: datetime
    reason: str | None = None
    # notAfter of the revoked certificate: after it the entry may be dropped (None: keep it)
    expires: datetime | None = None


def _from_utf8_der(value: bytes) -> str:
    if len(value) < 2 or value[0] != 0x0C or value[1] != len(value) - 2:
        raise ValueError("not a short DER UTF8String")
    return value[2:].decode()


def _entry_identity(entry: x509.RevokedCertificate) -> Identity | None:
    try:
        ext = entry.extensions.get_extension_for_oid(REVOKED_IDENTITY_OID).value
    except x509.ExtensionNotFound:
        return None
    try:
        assert isinstance(ext, x509.UnrecognizedExtension)
        return Identity.from_uri(_from_utf8_der(ext.value))
    except (AssertionError, ValueError, ConfigError):
        return None  # the serial alone decides; an unreadable label must not hide a revocation


def _entry_reason(entry: x509.RevokedCertificate) -> str | None:
    try:
        value = entry.extensions.get_extension_for_class(x509.CRLReason).value
    except x509.ExtensionNotFound:
        return None
    return value.reason.name


@dataclass(frozen=True, slots=True)
class RevocationList:
    crl: x509.CertificateRevocationList
    entries: tuple[Revocation, ...]
    number: int

    @property
    def serials(self) -> frozenset[int]:
        return frozenset(e.serial for e in self.entries)

    def is_revoked(self, serial: int) -> bool:
        return self.crl.get_revoked_certificate_by_serial_number(serial) is not None

    def to_pem(self) -> bytes:
        return self.crl.public_bytes(serialization.Encoding.PEM)

    @property
    def next_update(self) -> datetime | None:
        """When the list stops being fresh (None: a list without nextUpdate, fresh for ever)."""
        return self.crl.next_update_utc

    def expired(self, now: datetime | None = None) -> bool:
        """Past nextUpdate, forgiving :data:`~mesh.pki.policy.CLOCK_SKEW`: a verifier must not use it."""
        nu = self.crl.next_update_utc
        return nu is not None and nu + CLOCK_SKEW < (now or datetime.now(UTC))

    @classmethod
    def sign(cls, ca: CertificateAuthority, entries: Iterable[Revocation], *, number: int,
             now: datetime | None = None, lifetime: timedelta = CRL_LIFETIME) -> RevocationList:
        now = (now or datetime.now(UTC)).replace(microsecond=0)
        kept = sorted({e.serial: e for e in entries if e.expires is None or e.expires > now - CLOCK_SKEW}.values(),
                      key=lambda e: e.revoked_at)
        builder = (x509.CertificateRevocationListBuilder()
                   .issuer_name(ca.cert.subject).last_update(now)
                   .next_update(max(min(now + lifetime, ca.cert.not_valid_after_utc), now))
                   .add_extension(x509.CRLNumber(number), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
                                  critical=False))
        for e in kept:
            rb = x509.RevokedCertificateBuilder().serial_number(e.serial).revocation_date(e.revoked_at)
            if e.reason:
                rb = rb.add_extension(x509.CRLReason(x509.ReasonFlags[e.reason]), critical=False)
            builder = builder.add_revoked_certificate(rb.build())
        names = {e.serial: e.identity for e in kept if e.identity is not None}
        return cls.load(builder.sign(ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), ca.cert,
                        names=names, now=now)

    @classmethod
    def empty(cls, ca: CertificateAuthority, now: datetime | None = None) -> RevocationList:
        return cls.sign(ca, (), number=1, now=now)

    def add(self, ca: CertificateAuthority, revocations: Iterable[Revocation], *, now: datetime | None = None,
            expiry: Mapping[int, datetime] | None = None, lifetime: timedelta = CRL_LIFETIME) -> RevocationList:
        """A new list (number + 1, fresh for ``lifetime``) with ``revocations`` added: with none, the same list
        re-signed (a refresh). Entries whose certificate has expired (per ``Revocation.expires``, or ``expiry`` by
        serial for entries read back from a list) drop out."""
        expiry = expiry or {}
        old = (replace(e, expires=e.expires or expiry.get(e.serial)) for e in self.entries)
        return RevocationList.sign(ca, (*old, *revocations), number=self.number + 1, now=now, lifetime=lifetime)

    @classmethod
    def load(cls, pem: bytes, ca_cert: x509.Certificate, *, now: datetime | None = None,
             names: Mapping[int, Identity] | None = None, allow_expired: bool = False) -> RevocationList:
        """Parse and check a CRL: signed by ``ca_cert``, issued by it, not past nextUpdate (unless
        ``allow_expired``: a holder comparing numbers, or adopting a newer list to hold; its verifier still refuses
        to use it while it is expired). Anything else is a ``PkiError``: a list we cannot trust is our problem,
        never a reason to admit a peer. ``names``: who each serial was issued to (the issuance log), for the
        entries' ``identity``."""
        try:
            crl = x509.load_pem_x509_crl(pem)
        except ValueError as exc:
            raise PkiError(f"unreadable revocation list: {exc}") from exc
        pub = ca_cert.public_key()
        if (crl.issuer != ca_cert.subject or not isinstance(pub, ec.EllipticCurvePublicKey)
                or not crl.is_signature_valid(pub)):
            raise PkiError("the revocation list is not signed by the mesh CA")
        now = now or datetime.now(UTC)
        if not allow_expired and crl.next_update_utc is not None and crl.next_update_utc + CLOCK_SKEW < now:
            raise PkiError(f"the revocation list expired at {crl.next_update_utc:%Y-%m-%d %H:%M:%S}Z")
        try:
            number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
        except x509.ExtensionNotFound:
            number = 0
        names = names or {}
        entries = tuple(Revocation(serial=e.serial_number, identity=_entry_identity(e) or names.get(e.serial_number),
                                   revoked_at=e.revocation_date_utc, reason=_entry_reason(e)) for e in crl)
        return cls(crl, entries, number)


def crl_record(crl: RevocationList) -> dict[str, Any]:
    """The etcd value of ``pki/crl`` for ``crl``."""
    return {"schema": CRL_RECORD_SCHEMA, "number": crl.number, "pem": crl.to_pem().decode(),
            "identities": {f"{e.serial:x}": e.identity.uri for e in crl.entries if e.identity is not None}}


def crl_pem_from_record(value: Any) -> bytes:
    """The PEM inside a ``pki/crl`` value; ``ValueError`` for anything else. It is not verified here: the
    holder of the CA certificate does that (``RevocationList.load``, ``TrustStore.load_crl``)."""
    if not isinstance(value, dict) or value.get("schema") != CRL_RECORD_SCHEMA or not isinstance(value.get("pem"), str):
        raise ValueError(f"not a schema-{CRL_RECORD_SCHEMA} revocation list record")
    return value["pem"].encode()
