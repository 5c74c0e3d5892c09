"""Certificates the mesh CA would never issue, built by hand for the negative tests of ``verify``."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mesh.pki.ca import CertificateAuthority, IssuedCertificate, new_key
from mesh.pki.curve import curve_key_attribute

CLIENT, SERVER = ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH


def odd_leaf(ca: CertificateAuthority, *, uris: Sequence[str] = ("spiffe://tiermesh/tenant/acme",),
             dns: Sequence[str] = (), ekus: Sequence[x509.ObjectIdentifier] | None = (CLIENT,),
             ca_flag: bool | None = False, curve_public: bytes | None = None,
             lifetime: timedelta = timedelta(hours=1),
             extra: Sequence[x509.ExtensionType] = (),
             extra_subject: Sequence[x509.NameAttribute] = (),
             valid: tuple[datetime, datetime] | None = None) -> IssuedCertificate:
    """A leaf signed by ``ca`` with exactly the given SANs, EKUs (None: no EKU extension) and
    BasicConstraints (``ca_flag`` None: no BasicConstraints extension); ``valid``: (notBefore, notAfter)
    instead of one ``lifetime`` from a minute ago."""
    key = new_key()
    now = datetime.now(UTC)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    names += [x509.DNSName(d) for d in dns]
    subject = [x509.NameAttribute(NameOID.COMMON_NAME, "odd")]
    subject += [curve_key_attribute(curve_public)] if curve_public is not None else []
    subject += list(extra_subject)
    b = (x509.CertificateBuilder().subject_name(x509.Name(subject))
         .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(valid[0] if valid else now - timedelta(minutes=1))
         .not_valid_after(valid[1] if valid else now + lifetime))
    if names:
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if ekus is not None:
        b = b.add_extension(x509.ExtendedKeyUsage(list(ekus)), critical=False)
    if ca_flag is not None:
        b = b.add_extension(x509.BasicConstraints(ca=ca_flag, path_length=None), critical=True)
    for ext in extra:
        b = b.add_extension(ext, critical=False)
    return IssuedCertificate(b.sign(ca.key, hashes.SHA256()), key)
