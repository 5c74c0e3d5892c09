"""A site's certificate as etcd carries it (``pki/sites/<site>``): written by the site, read as hostile input."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.pki.ca import CertificateAuthority
from mesh.pki.files import cert_pem
from mesh.pki.identity import Identity
from mesh.pki.published import MAX_PEM_BYTES, cert_pem_from_record, site_cert_record

pytestmark = pytest.mark.unit


def test_a_published_certificate_round_trips() -> None:
    pem = cert_pem(CertificateAuthority.create().issue(Identity("site", "edge-1")).cert)
    assert cert_pem_from_record(site_cert_record(pem)) == pem


@pytest.mark.parametrize("value", [
    None, [], "pem", 7, {"schema": 2, "pem": "x"}, {"pem": "x"}, {"schema": 1}, {"schema": 1, "pem": 5},
    {"schema": 1, "pem": "not a certificate"},
    {"schema": 1, "pem": "-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----\n" * 2},
    {"schema": 1, "pem": "-----BEGIN CERTIFICATE-----\n" + "A" * MAX_PEM_BYTES + "\n-----END CERTIFICATE-----"},
    {"schema": 1, "pem": "-----BEGIN CERTIFICATE-----\n\u00e9\n-----END CERTIFICATE-----"},
    {"schema": 1, "pem": "-----BEGIN PRIVATE KEY-----\nA\n-----END PRIVATE KEY-----"},
])
def test_anything_else_is_one_value_error(value: Any) -> None:
    with pytest.raises(ValueError):
        cert_pem_from_record(value)
