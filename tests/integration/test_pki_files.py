"""The PKI's files: atomic private writes, the CURVE file's self-check, the issuance log behind revocation,
and a TrustStore that follows crl.pem (and adopts only newer lists from elsewhere)."""

from __future__ import annotations

import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mesh.errors import PkiError, Unauthenticated
from mesh.pki.ca import CertificateAuthority
from mesh.pki.crl import RevocationList
from mesh.pki.curve import CurveKeyPair
from mesh.pki.files import read_curve, write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.trust import TrustStore

pytestmark = pytest.mark.integration

TENANT, OTHER = Identity("tenant", "acme"), Identity("tenant", "other")


@pytest.fixture
def pki(tmp_path: Path) -> LocalPki:
    p = LocalPki.under(tmp_path)
    p.init()
    return p


def test_write_file_replaces_whole_files_with_the_right_mode(tmp_path: Path) -> None:
    path = tmp_path / "d" / "k.pem"
    write_file(path, b"one", private=True)
    assert path.read_bytes() == b"one" and stat.S_IMODE(path.stat().st_mode) == 0o600
    write_file(path, b"two")
    assert path.read_bytes() == b"two" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["k.pem"]  # no temp files left behind


def test_curve_file_whose_public_key_disagrees_is_refused(pki: LocalPki) -> None:
    site = Identity("site", "edge-1")
    pki.issue(site)
    path = pki.paths.curve(site)
    good = read_curve(path)
    text = path.read_text().replace(good.public.decode(), CurveKeyPair.generate().public.decode())
    path.write_text(text)
    with pytest.raises(PkiError, match="does not match"):
        read_curve(path)


def test_revoke_covers_every_live_certificate_of_the_identity_only(pki: LocalPki) -> None:
    first, second, other = pki.issue(TENANT), pki.issue(TENANT), pki.issue(OTHER)
    crl, new = pki.revoke(TENANT)
    assert set(new) == {first.serial, second.serial}
    assert crl.serials == {first.serial, second.serial} and not crl.is_revoked(other.serial)
    assert {e.identity for e in crl.entries} == {TENANT}
    assert pki.revoke(TENANT)[1] == []  # nothing new the second time
    after = pki.issue(TENANT)  # re-admitted by a new certificate
    assert not pki.crl().is_revoked(after.serial)


def test_revoked_entries_leave_the_list_once_their_certificates_expire(pki: LocalPki) -> None:
    short = pki.issue(TENANT, lifetime=timedelta(minutes=1))
    assert pki.revoke(TENANT)[0].is_revoked(short.serial)
    other = pki.issue(OTHER)
    crl, _ = pki.revoke(OTHER, now=datetime.now(UTC) + timedelta(hours=1))  # the next revocation, an hour on
    assert crl.is_revoked(other.serial) and not crl.is_revoked(short.serial)


def test_a_damaged_issuance_log_is_reported(pki: LocalPki) -> None:
    pki.issue(TENANT)
    with open(pki.paths.index, "a") as f:
        f.write("{not json\n")
    with pytest.raises(PkiError, match="damaged"):
        pki.listing()


def test_trust_store_follows_crl_pem(pki: LocalPki) -> None:
    issued = pki.issue(TENANT)
    trust = TrustStore.under(pki.paths)
    assert trust.verify(issued.cert, use="client") == TENANT
    assert not trust.refresh()
    pki.revoke(TENANT)
    assert trust.refresh()
    with pytest.raises(Unauthenticated):
        trust.verify(issued.cert, use="client")


def test_trust_store_keeps_its_list_when_the_new_file_is_forged(pki: LocalPki) -> None:
    issued = pki.issue(TENANT)
    pki.revoke(TENANT)
    trust = TrustStore.under(pki.paths)
    write_file(pki.paths.crl, RevocationList.empty(CertificateAuthority.create()).to_pem())
    assert not trust.refresh()
    with pytest.raises(Unauthenticated):
        trust.verify(issued.cert, use="client")  # still revoked


def test_trust_store_adopts_only_newer_lists_from_elsewhere(pki: LocalPki) -> None:
    issued = pki.issue(TENANT)
    trust = TrustStore.under(pki.paths)
    old_pem = pki.paths.crl.read_bytes()
    crl, _ = pki.revoke(TENANT)
    assert trust.load_crl(crl.to_pem())  # e.g. from etcd pki/crl
    assert not trust.load_crl(old_pem)  # an older list never undoes a revocation
    with pytest.raises(Unauthenticated):
        trust.verify(issued.cert, use="client")
    with pytest.raises(PkiError):
        trust.load_crl(RevocationList.empty(CertificateAuthority.create()).to_pem())
    write_file(pki.paths.crl, old_pem)  # the file goes back to an older list: the newer one stays
    trust.refresh()
    assert trust.crl is not None and trust.crl.number == crl.number


def test_a_list_written_before_is_re_signed_in_a_form_etcd_reads(pki: LocalPki) -> None:
    """Lists once carried the revoked identity as a private entry extension, which etcd's parser refuses: such a
    home's crl.pem is re-signed (same serials, number + 1) before etcd is given it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    from mesh.pki.policy import REVOKED_IDENTITY_OID

    pki.issue(TENANT)
    serial = pki.certificate(TENANT).serial_number
    ca = pki.ca()
    now = datetime.now(UTC)
    entry = (x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now)
             .add_extension(x509.UnrecognizedExtension(REVOKED_IDENTITY_OID, b"\x0c\x03abc"), critical=False).build())
    old = (x509.CertificateRevocationListBuilder().issuer_name(ca.cert.subject).last_update(now)
           .next_update(now + timedelta(days=1)).add_extension(x509.CRLNumber(7), critical=False)
           .add_revoked_certificate(entry).sign(ca.key, hashes.SHA256()))
    write_file(pki.paths.crl, old.public_bytes(serialization.Encoding.PEM))
    assert pki.standardise_crl()
    crl = pki.crl()
    assert crl.number == 8 and crl.serials == {serial}
    assert not any(ext.oid == REVOKED_IDENTITY_OID for e in crl.crl for ext in e.extensions)
    assert [e.identity for e in crl.entries] == [TENANT]  # named from the issuance log
    assert not pki.standardise_crl()  # already standard: left alone


def _serials(pki: LocalPki) -> dict[Identity, int]:
    return {r.identity: r.serial for r in pki.listing()}


def test_a_start_keeps_the_certificates_still_good_and_issues_only_what_changed(tmp_path: Path) -> None:
    """Issue 30: every `tiermesh up` re-issued every certificate (76 in `pki list` after 5 starts)."""
    from tiermesh.secure import OPERATOR, MeshCredentials

    creds = MeshCredentials.under(tmp_path)
    sites = {"edge-1": "127.0.0.1", "core-1": "127.0.0.1"}

    def start() -> None:
        creds.issue(sites, ["acme", "public"], etcd_address="127.0.0.1", store_address="127.0.0.1")

    start()
    first, lines = _serials(creds.pki), creds.pki.paths.index.read_text().splitlines()
    start()
    start()
    assert _serials(creds.pki) == first
    assert creds.pki.paths.index.read_text().splitlines() == lines  # issued.jsonl has not grown
    for who, serial in first.items():  # and the files on disk are those certificates
        assert creds.pki.certificate(who).serial_number == serial

    sites["edge-1"] = "10.0.0.7"  # a site that moved: its certificate names its new address
    creds.pki.revoke(Identity("tenant", "acme"))
    creds.pki.paths.key(OPERATOR).unlink()
    start()
    assert not creds.pki.renew(Identity("site", "edge-1"), addresses=["10.0.0.7"])  # kept from now on
    now = _serials(creds.pki)
    renewed = {who for who in first if now[who] != first[who]}
    assert renewed == {Identity("site", "edge-1"), Identity("tenant", "acme"), OPERATOR}
    assert len(creds.pki.paths.index.read_text().splitlines()) == len(lines) + 3

    creds.issue(sites, ["acme", "public"], etcd_address="127.0.0.1", store_address="127.0.0.1", rotate=True)
    assert all(s != now[who] for who, s in _serials(creds.pki).items())


def test_a_certificate_past_half_its_lifetime_or_of_another_ca_is_issued_again(pki: LocalPki, tmp_path: Path) -> None:
    site = Identity("site", "edge-1")
    assert pki.renew(site, addresses=["127.0.0.1"])  # none yet
    serial = pki.certificate(site).serial_number
    later = datetime.now(UTC) + timedelta(hours=11)
    assert not pki.renew(site, addresses=["127.0.0.1"], now=later)  # 13 h of 24 left
    assert pki.renew(site, addresses=["127.0.0.1"], now=later + timedelta(hours=2))  # 11 h left
    assert pki.certificate(site).serial_number != serial
    pki.init(force=True)  # a new CA: nothing the old one signed is kept
    assert pki.renew(site, addresses=["127.0.0.1"])
