"""CURVE key pairs for ZeroMQ links between sites, made without pyzmq (only ``mesh.zmq`` imports it).

ZeroMQ's CURVE is Curve25519 (X25519) with keys written in Z85 (ZeroMQ RFC 32): 32 raw bytes become 40
printable characters, which is what pyzmq's ``curve_keypair()`` returns and its ``CURVE_*KEY`` socket options
take. A site's public key is bound to its certificate by one subject attribute (see :func:`curve_key_attribute`),
so a ZAP handler can admit exactly the keys of valid site certificates. It is a standard attribute type with a
UTF8String value, not a private extension: etcd (Go) parses every extension of a client certificate, and Go
refuses the arcs of a registration-free UUID OID (2.25.<uuid>, above 2**31-1), so a private extension made every
site certificate unusable for etcd client auth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mesh.errors import ConfigError

if TYPE_CHECKING:  # cryptography is imported where keys are made or certificates read: an agent without
    from cryptography import x509  # credentials (--insecure) never loads it (edge footprint)

__all__ = [
    "CURVE_KEY_PREFIX",
    "CurveKeyPair",
    "curve_key_attribute",
    "curve_key_from_certificate",
    "raw_curve_key",
    "z85_decode",
    "z85_encode",
]

_Z85 = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_INDEX = {c: i for i, c in enumerate(_Z85)}
_KEY_BYTES, _KEY_Z85 = 32, 40
# The binding: subject organizationalUnitName "curve25519:<Z85 public key>" (11 + 40 characters, under the
# attribute's upper bound of 64).
CURVE_KEY_PREFIX = "curve25519:"


def z85_encode(raw: bytes) -> bytes:
    """Z85-encode ``raw`` (its length must be a multiple of 4, as the RFC requires)."""
    if len(raw) % 4:
        raise ConfigError(f"Z85 encodes multiples of 4 bytes, got {len(raw)}")
    out = bytearray()
    for i in range(0, len(raw), 4):
        v = int.from_bytes(raw[i:i + 4], "big")
        chunk = bytearray(5)
        for j in range(4, -1, -1):
            v, r = divmod(v, 85)
            chunk[j] = _Z85[r]
        out += chunk
    return bytes(out)


def z85_decode(text: bytes | str) -> bytes:
    data = text.encode("ascii", "replace") if isinstance(text, str) else bytes(text)
    if len(data) % 5:
        raise ConfigError(f"a Z85 string has a multiple of 5 characters, got {len(data)}")
    out = bytearray()
    for i in range(0, len(data), 5):
        v = 0
        for c in data[i:i + 5]:
            if c not in _Z85_INDEX:
                raise ConfigError(f"not a Z85 character: {chr(c)!r}")
            v = v * 85 + _Z85_INDEX[c]
        if v >= 1 << 32:
            raise ConfigError("Z85 group out of range")
        out += v.to_bytes(4, "big")
    return bytes(out)


def raw_curve_key(key: bytes | str) -> bytes:
    """The 32 raw bytes of a CURVE key given as 40 Z85 characters (or already raw)."""
    if isinstance(key, bytes) and len(key) == _KEY_BYTES:
        return key
    if len(key) != _KEY_Z85:
        raise ConfigError(f"a CURVE key is 40 Z85 characters (or 32 raw bytes), got {len(key)}")
    return z85_decode(key)


@dataclass(frozen=True, slots=True)
class CurveKeyPair:
    """Z85 bytes, as pyzmq's ``CURVE_PUBLICKEY`` / ``CURVE_SECRETKEY`` / ``CURVE_SERVERKEY`` take them."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"CurveKeyPair(public={self.public.decode()!r})"

    @classmethod
    def generate(cls) -> CurveKeyPair:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        return cls.from_secret(z85_encode(X25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())))

    @classmethod
    def from_secret(cls, secret: bytes | str) -> CurveKeyPair:
        """The pair whose secret is ``secret`` (Z85): the public key is derived, so the two always match."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        raw = raw_curve_key(secret)
        public = X25519PrivateKey.from_private_bytes(raw).public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(public=z85_encode(public), secret=z85_encode(raw))


def curve_key_attribute(public: bytes | str) -> x509.NameAttribute:
    """The subject attribute that binds a CURVE public key to a site certificate."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    value = CURVE_KEY_PREFIX + z85_encode(raw_curve_key(public)).decode()
    return x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, value)


def curve_key_from_certificate(cert: x509.Certificate) -> bytes | None:
    """The Z85 CURVE public key bound to ``cert``; None if it binds none. A malformed binding, or two, is a
    ``ConfigError`` (the verifier turns it into ``Unauthenticated``)."""
    from cryptography.x509.oid import NameOID

    bound = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
             if str(a.value).startswith(CURVE_KEY_PREFIX)]
    if not bound:
        return None
    if len(bound) > 1:
        raise ConfigError("certificate binds more than one CURVE key")
    try:
        raw = raw_curve_key(bound[0][len(CURVE_KEY_PREFIX):])
    except ConfigError as exc:
        raise ConfigError("malformed CURVE key binding in certificate") from exc
    return z85_encode(raw)
