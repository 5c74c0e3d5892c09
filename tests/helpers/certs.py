"""Throw-away certificates for tests that run etcd with TLS (made with ``cryptography``, EC P-256)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TestPKI:
    __test__ = False  # not a test class, despite the name

    ca: Path
    server_cert: Path  # for 127.0.0.1 / localhost; allows client auth too (etcd's health probe presents it)
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path     # a CA that signed nothing here


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, cn: str, *, server: bool,
          ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return key, b.sign(ca_key, hashes.SHA256())


def make_pki(directory: Path) -> TestPKI:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = _ca("tiermesh test CA")
    _, other = _ca("some other CA")
    s_key, s_cert = _leaf(ca_key, ca, "etcd-test-server", server=True)
    c_key, c_cert = _leaf(ca_key, ca, "tiermesh-test-client", server=False)
    pem = serialization.Encoding.PEM
    pki = TestPKI(ca=directory / "ca.pem", server_cert=directory / "server.pem", server_key=directory / "server.key",
                  client_cert=directory / "client.pem", client_key=directory / "client.key",
                  other_ca=directory / "other-ca.pem")
    pki.ca.write_bytes(ca.public_bytes(pem))
    pki.other_ca.write_bytes(other.public_bytes(pem))
    pki.server_cert.write_bytes(s_cert.public_bytes(pem))
    pki.client_cert.write_bytes(c_cert.public_bytes(pem))
    _write_key(s_key, pki.server_key)
    _write_key(c_key, pki.client_key)
    return pki
