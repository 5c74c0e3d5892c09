"""The mesh PKI without the network: identities, issuance per kind, and the negative matrix of ``verify``
(each way a certificate can fail, its own test, with the reason it fails for)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mesh.errors import ConfigError, PermissionDenied, PkiError, Unauthenticated
from mesh.pki.ca import CertificateAuthority
from mesh.pki.crl import Revocation, RevocationList, crl_record
from mesh.pki.curve import CURVE_KEY_PREFIX, CurveKeyPair, curve_key_from_certificate, z85_decode, z85_encode
from mesh.pki.identity import KINDS, Identity
from mesh.pki.policy import CLOCK_SKEW, EKUS, LIFETIMES, REVOKED_IDENTITY_OID, USE_EKU
from mesh.pki.verify import verify_certificate
from tests.helpers.pki_certs import CLIENT, SERVER, odd_leaf

pytestmark = pytest.mark.unit

TENANT, SITE = Identity("tenant", "acme"), Identity("site", "edge-1")


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.create()


@pytest.fixture(scope="module")
def crl(ca: CertificateAuthority) -> RevocationList:
    return RevocationList.empty(ca)


def _refused(reason: str, cert: x509.Certificate | bytes, ca: CertificateAuthority, crl: RevocationList | None,
             **kw: object) -> None:
    with pytest.raises(Unauthenticated) as info:
        verify_certificate(cert, ca=ca.cert, crl=crl, **{"use": "client", **kw})  # type: ignore[arg-type]
    assert info.value.reason == reason, info.value
    assert info.value.http_status == 401 and info.value.code == "unauthenticated"


# --- identities ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_identity_uri_round_trips(kind: str) -> None:
    ident = Identity(kind, "a-1")  # type: ignore[arg-type]
    assert ident.uri == f"spiffe://tiermesh/{kind}/a-1"
    assert Identity.from_uri(ident.uri) == ident


@pytest.mark.parametrize("name", ["", "A", "a_b", "-a", "a-", "a/b", "a.b", "x" * 64, "é"])
def test_identity_refuses_bad_names(name: str) -> None:
    with pytest.raises(ConfigError, match="invalid tenant name"):
        Identity("tenant", name)


@pytest.mark.parametrize("uri", ["spiffe://tiermesh/tenant/a/b", "spiffe://tiermesh/tenant/", "spiffe://other/tenant/a",
                                 "spiffe://tiermesh/robot/a", "https://tiermesh/tenant/a", "spiffe://tiermesh:1/tenant/a",
                                 "spiffe://tiermesh/tenant/a?x=1"])
def test_identity_parse_is_exact(uri: str) -> None:
    with pytest.raises(ConfigError):
        Identity.from_uri(uri)


# --- CURVE keys ----------------------------------------------------------------------------------------------

def test_z85_matches_the_rfc_example() -> None:
    raw = bytes([0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B])
    assert z85_encode(raw) == b"HelloWorld"
    assert z85_decode("HelloWorld") == raw


def test_z85_refuses_bad_input() -> None:
    with pytest.raises(ConfigError):
        z85_encode(b"abc")
    with pytest.raises(ConfigError):
        z85_decode("Hell")
    with pytest.raises(ConfigError):
        z85_decode("Hello Worl")  # space is not in the alphabet
    with pytest.raises(ConfigError):
        z85_decode("#####")  # 85**5 - 1 does not fit in 4 bytes


def test_curve_pair_public_is_derived_from_secret() -> None:
    pair = CurveKeyPair.generate()
    assert len(pair.public) == len(pair.secret) == 40
    assert CurveKeyPair.from_secret(pair.secret) == pair
    assert pair.secret.decode() not in repr(pair)
    assert CurveKeyPair.generate().public != pair.public


# --- issuance --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_gets_one_uri_san_its_ekus_and_a_short_life(ca: CertificateAuthority, crl: RevocationList,
                                                               kind: str) -> None:
    ident = Identity(kind, "n1")  # type: ignore[arg-type]
    issued = ca.issue(ident)
    cert = issued.cert
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [ident.uri]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.digital_signature and not ku.key_cert_sign
    ekus = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert ekus == {USE_EKU[u] for u in EKUS[ident.kind]}
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert life == LIFETIMES[ident.kind] + CLOCK_SKEW  # notBefore is backdated by the skew
    for use in EKUS[ident.kind]:
        assert verify_certificate(cert, ca=ca.cert, crl=crl, use=use) == ident


def test_tenants_and_admins_are_clients_only(ca: CertificateAuthority, crl: RevocationList) -> None:
    assert EKUS["tenant"] == ("client",) and EKUS["admin"] == ("client",)
    assert set(EKUS["site"]) == {"client", "server"} and "server" in EKUS["scheduler"]


def test_site_addresses_become_dns_and_ip_sans(ca: CertificateAuthority) -> None:
    cert = ca.issue(SITE, addresses=["127.0.0.1", "Edge-1.Example", "::1"]).cert
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["edge-1.example"]
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    assert len(san.get_values_for_type(x509.UniformResourceIdentifier)) == 1


@pytest.mark.parametrize("bad", ["127.0.0.1:80", "a..b", "-x.com", "http://x", ""])
def test_bad_addresses_are_refused(ca: CertificateAuthority, bad: str) -> None:
    with pytest.raises(ConfigError):
        ca.issue(SITE, addresses=[bad])


def test_only_sites_take_addresses_or_curve_keys(ca: CertificateAuthority) -> None:
    with pytest.raises(ConfigError):
        ca.issue(TENANT, addresses=["127.0.0.1"])
    with pytest.raises(ConfigError):
        ca.issue(TENANT, curve_public=CurveKeyPair.generate().public)


def test_lifetime_is_overridable_and_capped_by_the_ca(ca: CertificateAuthority) -> None:
    short = ca.issue(TENANT, lifetime=timedelta(minutes=30)).cert
    assert short.not_valid_after_utc - short.not_valid_before_utc == timedelta(minutes=30) + CLOCK_SKEW
    long = ca.issue(TENANT, lifetime=timedelta(days=3650)).cert
    assert long.not_valid_after_utc == ca.cert.not_valid_after_utc
    with pytest.raises(ConfigError):
        ca.issue(TENANT, lifetime=timedelta(0))


def test_ca_certificate_signs_leaves_only(ca: CertificateAuthority) -> None:
    bc = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    assert ca.cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign


# --- the negative matrix of verify --------------------------------------------------------------------------

def test_wrong_ca(ca: CertificateAuthority, crl: RevocationList) -> None:
    other = CertificateAuthority.create()  # same subject name as ours: only the signature tells them apart
    assert other.cert.subject == ca.cert.subject
    _refused("wrong_ca", other.issue(TENANT).cert, ca, crl)


def test_expired(ca: CertificateAuthority, crl: RevocationList) -> None:
    cert = ca.issue(TENANT, lifetime=timedelta(hours=1)).cert
    _refused("expired", cert, ca, crl, now=cert.not_valid_after_utc + CLOCK_SKEW + timedelta(seconds=1))


def test_expired_within_the_skew_allowance_still_passes(ca: CertificateAuthority, crl: RevocationList) -> None:
    cert = ca.issue(TENANT, lifetime=timedelta(hours=1)).cert
    assert verify_certificate(cert, ca=ca.cert, crl=crl, use="client",
                              now=cert.not_valid_after_utc + CLOCK_SKEW - timedelta(seconds=1)) == TENANT


def test_not_yet_valid(ca: CertificateAuthority, crl: RevocationList) -> None:
    cert = ca.issue(TENANT, now=datetime.now(UTC) + timedelta(hours=1)).cert
    _refused("not_yet_valid", cert, ca, crl)


def test_revoked(ca: CertificateAuthority, crl: RevocationList) -> None:
    cert = ca.issue(TENANT).cert
    other = ca.issue(TENANT).cert
    revoked = crl.add(ca, [Revocation(cert.serial_number, TENANT, datetime.now(UTC), "key_compromise")])
    _refused("revoked", cert, ca, revoked)
    assert verify_certificate(other, ca=ca.cert, crl=revoked, use="client") == TENANT  # only that serial


def test_two_uri_sans(ca: CertificateAuthority, crl: RevocationList) -> None:
    cert = odd_leaf(ca, uris=["spiffe://tiermesh/tenant/acme", "spiffe://tiermesh/tenant/evil"]).cert
    _refused("san", cert, ca, crl)


def test_no_uri_san(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("san", odd_leaf(ca, uris=[], dns=["acme.example"]).cert, ca, crl)


def test_uri_san_of_another_trust_domain(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("san", odd_leaf(ca, uris=["spiffe://elsewhere/tenant/acme"]).cert, ca, crl)


def test_wrong_kind(ca: CertificateAuthority, crl: RevocationList) -> None:
    with pytest.raises(PermissionDenied) as info:
        verify_certificate(ca.issue(TENANT).cert, ca=ca.cert, crl=crl, use="client", kinds=("site",))
    assert info.value.reason == "wrong_kind" and info.value.http_status == 403


def test_missing_client_auth_for_client_use(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("eku", odd_leaf(ca, ekus=[SERVER]).cert, ca, crl, use="client")


def test_missing_server_auth_for_server_use(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("eku", ca.issue(TENANT).cert, ca, crl, use="server")


def test_no_eku_extension_at_all(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("eku", odd_leaf(ca, ekus=None).cert, ca, crl)


def test_any_extended_key_usage_is_not_enough(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("eku", odd_leaf(ca, ekus=[CLIENT, ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE]).cert, ca, crl)


def test_ca_true_leaf(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("ca_certificate", odd_leaf(ca, ca_flag=True).cert, ca, crl)


def test_leaf_without_basic_constraints(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("ca_certificate", odd_leaf(ca, ca_flag=None).cert, ca, crl)


def test_the_ca_itself_is_not_a_peer(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("ca_certificate", ca.cert, ca, crl)


def test_curve_key_not_the_bound_one(ca: CertificateAuthority, crl: RevocationList) -> None:
    bound, presented = CurveKeyPair.generate(), CurveKeyPair.generate()
    cert = ca.issue(SITE, curve_public=bound.public).cert
    _refused("curve_binding", cert, ca, crl, use="server", curve_public=presented.public)
    assert verify_certificate(cert, ca=ca.cert, crl=crl, use="server", curve_public=bound.public) == SITE


def test_curve_key_with_a_certificate_that_binds_none(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("curve_binding", ca.issue(SITE).cert, ca, crl, use="server",
             curve_public=CurveKeyPair.generate().public)


def test_curve_binding_is_a_subject_attribute_and_no_private_extension(ca: CertificateAuthority) -> None:
    pair = CurveKeyPair.generate()
    cert = ca.issue(SITE, curve_public=pair.public).cert
    assert curve_key_from_certificate(cert) == pair.public
    assert curve_key_from_certificate(ca.issue(SITE).cert) is None
    # every extension OID fits Go's ASN.1 parser (arcs <= 2**31-1): etcd parses client certificates
    for ext in cert.extensions:
        assert all(int(arc) < 2**31 for arc in ext.oid.dotted_string.split(".")), ext.oid


def test_malformed_curve_binding(ca: CertificateAuthority, crl: RevocationList) -> None:
    pair = CurveKeyPair.generate()
    short = x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, CURVE_KEY_PREFIX + pair.public.decode()[:20])
    cert = odd_leaf(ca, uris=[SITE.uri], ekus=[SERVER], extra_subject=[short]).cert
    _refused("curve_binding", cert, ca, crl, use="server", curve_public=pair.public)
    other = CurveKeyPair.generate()
    two = odd_leaf(ca, uris=[SITE.uri], ekus=[SERVER], curve_public=pair.public,
                   extra_subject=[x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME,
                                                     CURVE_KEY_PREFIX + other.public.decode())]).cert
    _refused("curve_binding", two, ca, crl, use="server", curve_public=pair.public)


def test_not_a_certificate(ca: CertificateAuthority, crl: RevocationList) -> None:
    _refused("bad_certificate", b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n", ca, crl)
    _refused("bad_certificate", b"\x30\x03\x02\x01\x00", ca, crl)


def test_pem_and_der_both_verify(ca: CertificateAuthority, crl: RevocationList) -> None:
    cert = ca.issue(TENANT).cert
    for data in (cert.public_bytes(serialization.Encoding.PEM), cert.public_bytes(serialization.Encoding.DER)):
        assert verify_certificate(data, ca=ca.cert, crl=crl, use="client") == TENANT


# --- the revocation list --------------------------------------------------------------------------------------

def test_crl_names_identities_and_reasons_and_counts_up(ca: CertificateAuthority) -> None:
    now = datetime.now(UTC)
    crl1 = RevocationList.empty(ca)
    crl2 = crl1.add(ca, [Revocation(7, TENANT, now, "key_compromise")])
    crl3 = crl2.add(ca, [Revocation(9, SITE, now)])
    assert {(e.serial, e.identity, e.reason) for e in crl3.entries} == {(7, TENANT, "key_compromise"),
                                                                          (9, SITE, None)}
    again = RevocationList.load(crl3.to_pem(), ca.cert)  # the PEM alone: serials and reasons, no names
    assert (crl1.number, crl2.number, again.number) == (1, 2, 3)
    assert {(e.serial, e.identity, e.reason) for e in again.entries} == {(7, None, "key_compromise"), (9, None, None)}
    named = RevocationList.load(crl3.to_pem(), ca.cert, names={7: TENANT, 9: SITE})  # names from the issuance log
    assert {(e.serial, e.identity) for e in named.entries} == {(7, TENANT), (9, SITE)}
    assert again.is_revoked(7) and again.is_revoked(9) and not again.is_revoked(8)
    # nothing but standard extensions: Go's parser (etcd's --client-crl-file) refuses tiermesh's private OID arc
    assert {ext.oid for entry in again.crl for ext in entry.extensions} == {x509.oid.CRLEntryExtensionOID.CRL_REASON}
    assert crl_record(crl3)["identities"] == {"7": TENANT.uri, "9": SITE.uri}


def test_a_list_written_before_still_names_its_identities(ca: CertificateAuthority) -> None:
    """Lists written before carried the identity as a private entry extension: still read."""
    from cryptography.hazmat.primitives import hashes

    entry = (x509.RevokedCertificateBuilder().serial_number(5).revocation_date(datetime.now(UTC))
             .add_extension(x509.UnrecognizedExtension(REVOKED_IDENTITY_OID, b"\x0c" + bytes([len(TENANT.uri)])
                                                       + TENANT.uri.encode()), critical=False).build())
    now = datetime.now(UTC)
    old = (x509.CertificateRevocationListBuilder().issuer_name(ca.cert.subject).last_update(now)
           .next_update(now + timedelta(days=1)).add_extension(x509.CRLNumber(4), critical=False)
           .add_revoked_certificate(entry).sign(ca.key, hashes.SHA256()))
    crl = RevocationList.load(old.public_bytes(serialization.Encoding.PEM), ca.cert)
    assert [(e.serial, e.identity) for e in crl.entries] == [(5, TENANT)] and crl.number == 4


def test_crl_drops_entries_whose_certificate_expired(ca: CertificateAuthority) -> None:
    now = datetime.now(UTC)
    crl = RevocationList.empty(ca).add(ca, [Revocation(1, TENANT, now, expires=now - timedelta(hours=1)),
                                            Revocation(2, TENANT, now, expires=now + timedelta(hours=1))])
    assert crl.serials == {2}


def test_crl_from_another_ca_is_refused(ca: CertificateAuthority) -> None:
    forged = RevocationList.empty(CertificateAuthority.create())
    with pytest.raises(PkiError, match="not signed by the mesh CA"):
        RevocationList.load(forged.to_pem(), ca.cert)


def test_crl_past_next_update_is_refused(ca: CertificateAuthority) -> None:
    crl = RevocationList.empty(ca)
    assert crl.crl.next_update_utc is not None
    with pytest.raises(PkiError, match="expired"):
        RevocationList.load(crl.to_pem(), ca.cert, now=crl.crl.next_update_utc + timedelta(hours=1))


def test_garbage_crl_is_a_pki_error(ca: CertificateAuthority) -> None:
    with pytest.raises(PkiError):
        RevocationList.load(b"not a crl", ca.cert)
