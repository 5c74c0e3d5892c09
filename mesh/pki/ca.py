"""The mesh certificate authority: an EC P-256 key that signs short-lived leaf certificates for identities.

A CA certificate: ``BasicConstraints(ca=True, path_length=0)`` (it signs leaves only), key usage
``keyCertSign`` + ``cRLSign``. A leaf: ``ca=False``; key usage ``digitalSignature``; exactly one URI SAN (the
identity), plus DNS / IP SANs for a site's advertised addresses when given; extended key usages by kind
(:data:`mesh.pki.policy.EKUS`); a site's CURVE public key in a private extension when given. Lifetimes and
the backdating of notBefore come from :mod:`mesh.pki.policy`. Pure: no files (see :mod:`mesh.pki.files`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mesh.errors import ConfigError
from mesh.pki.curve import curve_key_attribute
from mesh.pki.identity import Identity
from mesh.pki.policy import CA_LIFETIME, CLOCK_SKEW, EKUS, LIFETIMES, USE_EKU

__all__ = ["CertificateAuthority", "IssuedCertificate", "new_key", "san_for_address"]

_SIG = hashes.SHA256()


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _now(now: datetime | None) -> datetime:
    return (now or datetime.now(UTC)).replace(microsecond=0)


def _check_lifetime(lifetime: timedelta) -> timedelta:
    if lifetime <= timedelta(0):
        raise ConfigError(f"a certificate lifetime must be positive, got {lifetime}")
    return lifetime


def san_for_address(address: str) -> x509.GeneralName:
    """An IP SAN for an IP address, a DNS SAN for a host name (``host:port`` is refused: no port in a SAN)."""
    try:
        return x509.IPAddress(ipaddress.ip_address(address))
    except ValueError:
        pass
    host = address.rstrip(".")
    labels = host.split(".")
    if not host or len(host) > 253 or not all(
            0 < len(lb) <= 63 and lb.replace("-", "").isalnum() and lb.isascii()
            and not lb.startswith("-") and not lb.endswith("-") for lb in labels):
        raise ConfigError(f"not an IP address or DNS name: {address!r}")
    return x509.DNSName(host.lower())


@dataclass(frozen=True, slots=True)
class IssuedCertificate:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def serial(self) -> int:
        return self.cert.serial_number


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, *, lifetime: timedelta = CA_LIFETIME, now: datetime | None = None,
               common_name: str = "tiermesh mesh CA") -> CertificateAuthority:
        key = new_key()
        start = _now(now)
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tiermesh"),
                          x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (x509.CertificateBuilder()
                .subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start - CLOCK_SKEW).not_valid_after(start + _check_lifetime(lifetime))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(ski, critical=False)
                .sign(key, _SIG))
        return cls(cert, key)

    def issue(self, identity: Identity, *, lifetime: timedelta | None = None, addresses: Sequence[str] = (),
              curve_public: bytes | str | None = None, now: datetime | None = None,
              key: ec.EllipticCurvePrivateKey | None = None) -> IssuedCertificate:
        """A leaf certificate for ``identity`` (a fresh key unless ``key`` is given). ``addresses`` (DNS names
        or IPs) are for the kinds that serve (a site's edge API, a scheduler's console); ``curve_public`` (Z85)
        for sites only. It never outlives the CA."""
        if "server" not in EKUS[identity.kind] and addresses:
            raise ConfigError(f"addresses are for certificates that serve (site, scheduler), not {identity.kind}")
        if identity.kind != "site" and curve_public is not None:
            raise ConfigError(f"CURVE keys are for site certificates, not {identity.kind}")
        key = key or new_key()
        start = _now(now)
        life = _check_lifetime(LIFETIMES[identity.kind] if lifetime is None else lifetime)
        end = min(start + life, self.cert.not_valid_after_utc)
        if end <= start:
            raise ConfigError("the CA has expired: run `tiermesh pki init --force` to make a new one")
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
        names += [san_for_address(a) for a in dict.fromkeys(addresses)]
        subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tiermesh")]
        if curve_public is not None:
            subject.append(curve_key_attribute(curve_public))
        subject.append(x509.NameAttribute(NameOID.COMMON_NAME, identity.common_name))
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name(subject))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(max(start - CLOCK_SKEW, self.cert.not_valid_before_utc))
                   .not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False,
                                                key_agreement=False, key_cert_sign=False, crl_sign=False,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([USE_EKU[u] for u in EKUS[identity.kind]]),
                                  critical=False)
                   .add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                                  critical=False))
        return IssuedCertificate(builder.sign(self.key, _SIG), key)
