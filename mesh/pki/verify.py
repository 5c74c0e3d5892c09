"""Strict verification of a peer's certificate: returns the :class:`Identity` it proves, or raises.

Checks, in order (each failure an ``Unauthenticated`` with its ``reason``, except the kind):

    parse            bad_certificate   DER or PEM X.509
    issuer           wrong_ca          issued and signed by our CA (one level: the CA signs leaves only)
    validity         not_yet_valid / expired   within notBefore..notAfter, forgiving policy.CLOCK_SKEW
    not a CA         ca_certificate    BasicConstraints present with ca=False, no keyCertSign
    identity         san               exactly one URI SAN, a valid spiffe://tiermesh/<kind>/<name>
    kind             (PermissionDenied wrong_kind)  one of the kinds the caller expects
    use              eku               the EKU for the use: clientAuth for a client, serverAuth for a server
    revocation       crl_expired       the revocation list held is fresh (within its nextUpdate): a verifier whose
                                       list nobody re-signed admits no one (fail closed; see mesh.pki.crl)
                     revoked           serial not on the CA-signed revocation list
    CURVE binding    curve_binding     when a CURVE key is presented: the certificate binds exactly that key

TLS (``ssl`` with ``CERT_REQUIRED``) already checks the chain and validity at the handshake; this runs after
it on the peer's certificate (``getpeercert(binary_form=True)``), and alone for ZeroMQ, where there is no TLS.
"""

from __future__ import annotations

import ssl
from collections.abc import Collection
from datetime import UTC, datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from mesh.errors import ConfigError, PermissionDenied, Unauthenticated
from mesh.pki.crl import RevocationList
from mesh.pki.curve import curve_key_from_certificate, raw_curve_key
from mesh.pki.identity import KINDS, Identity, Kind
from mesh.pki.policy import CLOCK_SKEW, USE_EKU, Use

__all__ = ["load_certificate", "peer_certificate", "verify_certificate"]


def load_certificate(data: bytes | x509.Certificate) -> x509.Certificate:
    if isinstance(data, x509.Certificate):
        return data
    try:
        return x509.load_pem_x509_certificate(data) if data.lstrip().startswith(b"-----") \
            else x509.load_der_x509_certificate(data)
    except ValueError as exc:
        raise Unauthenticated("not an X.509 certificate", reason="bad_certificate") from exc


def peer_certificate(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> x509.Certificate:
    """The certificate the TLS peer presented; ``Unauthenticated(no_certificate)`` if it presented none."""
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise Unauthenticated("no client certificate", reason="no_certificate")
    return load_certificate(der)


def _fail(reason: str, message: str) -> Unauthenticated:
    return Unauthenticated(message, reason=reason)


def _ext(cert: x509.Certificate, cls: type[x509.ExtensionType]) -> x509.ExtensionType | None:
    try:
        return cert.extensions.get_extension_for_class(cls).value
    except x509.ExtensionNotFound:
        return None
    except ValueError as exc:  # duplicate or malformed extensions
        raise _fail("bad_certificate", f"malformed certificate extensions: {exc}") from exc


def _check_issuer(cert: x509.Certificate, ca: x509.Certificate) -> None:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise _fail("wrong_ca", "certificate not issued by the mesh CA") from exc


def _check_validity(cert: x509.Certificate, now: datetime) -> None:
    if now + CLOCK_SKEW < cert.not_valid_before_utc:
        raise _fail("not_yet_valid", f"certificate not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S}Z")
    if now - CLOCK_SKEW > cert.not_valid_after_utc:
        raise _fail("expired", f"certificate expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S}Z")


def _check_leaf(cert: x509.Certificate) -> None:
    bc = _ext(cert, x509.BasicConstraints)
    ku = _ext(cert, x509.KeyUsage)
    if not isinstance(bc, x509.BasicConstraints) or bc.ca or (isinstance(ku, x509.KeyUsage) and ku.key_cert_sign):
        raise _fail("ca_certificate", "a CA certificate (or one without BasicConstraints) is not a peer identity")


def _identity(cert: x509.Certificate) -> Identity:
    san = _ext(cert, x509.SubjectAlternativeName)
    uris = san.get_values_for_type(x509.UniformResourceIdentifier) if isinstance(
        san, x509.SubjectAlternativeName) else []
    if len(uris) != 1:
        raise _fail("san", f"a peer certificate needs exactly one URI SAN, this one has {len(uris)}")
    try:
        return Identity.from_uri(uris[0])
    except ConfigError as exc:
        raise _fail("san", f"URI SAN is not a tiermesh identity: {exc}") from exc


def _check_use(cert: x509.Certificate, use: Use) -> None:
    eku = _ext(cert, x509.ExtendedKeyUsage)
    usages = list(eku) if isinstance(eku, x509.ExtendedKeyUsage) else []
    if USE_EKU[use] not in usages or ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE in usages:
        raise _fail("eku", f"certificate not issued for {use} use (extended key usage)")


def _check_curve(cert: x509.Certificate, presented: bytes | str) -> None:
    try:
        bound = curve_key_from_certificate(cert)
        presented_raw = raw_curve_key(presented)
    except ConfigError as exc:
        raise _fail("curve_binding", str(exc)) from exc
    if bound is None or raw_curve_key(bound) != presented_raw:
        raise _fail("curve_binding", "the CURVE key presented is not the one this certificate binds")


def verify_certificate(cert: bytes | x509.Certificate, *, ca: x509.Certificate, crl: RevocationList | None,
                       use: Use, kinds: Collection[Kind] = KINDS, curve_public: bytes | str | None = None,
                       now: datetime | None = None) -> Identity:
    """The identity ``cert`` proves for ``use`` ("client" / "server"), if it is one of ``kinds``.

    ``crl`` None means "no revocation list" and is allowed only where the caller has decided so (tests, a
    first boot): pass the CA's list wherever there is one. ``curve_public`` (Z85 or raw): also require that
    the certificate binds exactly this CURVE key.
    """
    leaf = load_certificate(cert)
    now = now or datetime.now(UTC)
    _check_issuer(leaf, ca)
    _check_validity(leaf, now)
    _check_leaf(leaf)
    identity = _identity(leaf)
    if identity.kind not in kinds:
        raise PermissionDenied(f"{identity} is a {identity.kind}; expected {' or '.join(kinds)}",
                               reason="wrong_kind")
    _check_use(leaf, use)
    if crl is not None and crl.expired(now):
        raise _fail("crl_expired", f"the revocation list held (number {crl.number}) expired at "
                                   f"{crl.next_update:%Y-%m-%d %H:%M:%S}Z: no certificate is accepted until a fresh "
                                   f"one arrives (the CA's holder re-signs it: `tiermesh pki refresh-crl`)")
    if crl is not None and crl.is_revoked(leaf.serial_number):
        raise _fail("revoked", f"certificate {leaf.serial_number:x} of {identity} is revoked")
    if curve_public is not None:
        _check_curve(leaf, curve_public)
    return identity
