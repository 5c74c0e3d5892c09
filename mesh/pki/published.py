"""A site's certificate as published in etcd ``pki/sites/<site>``: ``{"schema": 1, "pem": "-----BEGIN ..."}``.

etcd is how peers learn each other's certificate (and so the CURVE key it binds and the addresses it names), never
why they believe it: a reader verifies the PEM against the CA and the revocation list it holds
(:class:`mesh.zmq.curve.SiteKeys`). The site writes its own record (etcd RBAC lets ``site:S`` write exactly
``pki/sites/S``), and so does ``tiermesh pki issue`` for an operator.

The value comes from etcd, so it is hostile input: :func:`cert_pem_from_record` turns anything but a schema-1 record
holding one PEM certificate of at most :data:`MAX_PEM_BYTES` into one ``ValueError``. It does not parse the
certificate (the verifier does, and refuses what does not verify).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_PEM_BYTES", "SITE_CERT_SCHEMA", "cert_pem_from_record", "site_cert_record"]

SITE_CERT_SCHEMA = 1
# A mesh certificate is under 1 KiB of PEM; 16 KiB leaves room for long SAN lists and refuses a value meant to cost
# every reader memory and parse time
MAX_PEM_BYTES = 16 * 1024
_BEGIN, _END = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"


def site_cert_record(pem: bytes) -> dict[str, Any]:
    """The etcd value publishing one site's certificate (PEM)."""
    return {"schema": SITE_CERT_SCHEMA, "pem": pem.decode("ascii")}


def cert_pem_from_record(value: Any) -> bytes:
    """The PEM inside a ``pki/sites/<site>`` value; ``ValueError`` for anything else (not verified here)."""
    if not isinstance(value, dict) or value.get("schema") != SITE_CERT_SCHEMA:
        raise ValueError(f"not a schema-{SITE_CERT_SCHEMA} site certificate record")
    pem = value.get("pem")
    if not isinstance(pem, str) or len(pem) > MAX_PEM_BYTES:
        raise ValueError(f"a site certificate record holds one PEM string of at most {MAX_PEM_BYTES} characters")
    text = pem.strip()
    if not text.isascii() or not text.startswith(_BEGIN) or not text.endswith(_END) or text.count(_BEGIN) != 1:
        raise ValueError("a site certificate record holds exactly one PEM certificate")
    return text.encode("ascii") + b"\n"
