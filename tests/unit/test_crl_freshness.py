"""Revocation lists are fresh for two days, not for the CA's life; a verifier holding an expired list admits no one
(fail closed) until a fresher one arrives; whoever holds the CA re-signs the list before then (``LocalPki.refresh_crl``,
``tiermesh pki refresh-crl``, ``tiermesh up``'s :class:`~tiermesh.crl_refresh.CrlRefresher`)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mesh.errors import Unauthenticated
from mesh.pki.ca import CertificateAuthority
from mesh.pki.crl import Revocation, RevocationList
from mesh.pki.files import write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.policy import CLOCK_SKEW, CRL_LIFETIME, CRL_REFRESH
from mesh.pki.trust import TrustStore
from mesh.pki.verify import verify_certificate
from tiermesh.cli.main import EXIT_OK, main
from tiermesh.crl_refresh import CrlRefresher

pytestmark = pytest.mark.unit

TENANT, OTHER = Identity("tenant", "acme"), Identity("tenant", "globex")


@pytest.fixture
def pki(tmp_path: Path) -> LocalPki:
    p = LocalPki.under(tmp_path / "home")
    p.init()
    p.issue(TENANT)
    p.issue(OTHER)
    return p


def _aged(pki: LocalPki, age: timedelta) -> RevocationList:
    """crl.pem re-signed as if ``age`` ago (its entries kept), as a home left alone that long holds it."""
    old = pki.crl().add(pki.ca(), [], now=datetime.now(UTC) - age)
    write_file(pki.paths.crl, old.to_pem())
    return old


def test_a_list_is_fresh_for_two_days_not_for_the_cas_life() -> None:
    ca = CertificateAuthority.create()
    crl = RevocationList.empty(ca)
    assert crl.next_update is not None
    life = crl.next_update - crl.crl.last_update_utc
    assert life == CRL_LIFETIME < ca.cert.not_valid_after_utc - ca.cert.not_valid_before_utc
    assert CRL_REFRESH * 4 <= CRL_LIFETIME  # a refresh missed or three leave the list fresh
    short = CertificateAuthority.create(lifetime=timedelta(hours=5))  # never past the CA
    assert RevocationList.empty(short).next_update == short.cert.not_valid_after_utc


def test_a_verifier_holding_an_expired_list_admits_no_one(pki: LocalPki) -> None:
    """A list a month old was accepted and used (its nextUpdate was the CA's notAfter): now every certificate is
    refused, unrevoked ones too, and the refusal names the fix."""
    ca, cert = pki.ca(), pki.certificate(TENANT)
    stale = RevocationList.empty(ca, now=datetime.now(UTC) - timedelta(days=3))
    with pytest.raises(Unauthenticated) as info:
        verify_certificate(cert, ca=ca.cert, crl=stale, use="client")
    assert info.value.reason == "crl_expired" and "refresh-crl" in info.value.message
    # a minute past its nextUpdate, within the clock skew forgiven, it still passes
    late = RevocationList.empty(ca, now=datetime.now(UTC) - CRL_LIFETIME - CLOCK_SKEW / 2)
    assert verify_certificate(cert, ca=ca.cert, crl=late, use="client") == TENANT


def test_refresh_keeps_the_revocations_and_counts_up(pki: LocalPki) -> None:
    crl, _ = pki.revoke(OTHER)
    old = _aged(pki, timedelta(days=3))
    assert old.expired()
    fresh = pki.refresh_crl()
    assert fresh.number == old.number + 1 and not fresh.expired() and fresh.serials == crl.serials
    assert pki.crl().number == fresh.number  # written to crl.pem
    with pytest.raises(Unauthenticated, match="revoked"):
        verify_certificate(pki.certificate(OTHER), ca=pki.ca().cert, crl=fresh, use="client")


def test_a_holder_keeps_an_expired_list_and_takes_a_fresher_one(pki: LocalPki) -> None:
    """A host restarted with a stale crl.pem starts (it does not crash on the file), refuses everyone, and is back
    as soon as a fresh list arrives (from etcd: load_crl; or its file)."""
    _aged(pki, timedelta(days=3))
    trust = TrustStore.under(pki.paths)
    assert trust.crl is not None and trust.crl.expired()
    with pytest.raises(Unauthenticated, match="expired"):
        trust.verify(pki.certificate(TENANT), use="client")
    fresh = pki.crl().add(pki.ca(), [])
    assert trust.load_crl(fresh.to_pem())
    assert trust.verify(pki.certificate(TENANT), use="client") == TENANT
    # a newer list is adopted even when it is itself expired: it names every revocation an older one does
    newer_but_stale = fresh.add(pki.ca(), [Revocation(pki.certificate(OTHER).serial_number, OTHER,
                                                      datetime.now(UTC))], now=datetime.now(UTC) - timedelta(days=3))
    assert trust.load_crl(newer_but_stale.to_pem()) and trust.crl is not None and trust.crl.expired()


def test_the_operators_own_expired_list_can_still_be_revoked_into(pki: LocalPki) -> None:
    """`pki revoke` on a home whose list expired: it re-signs, it does not refuse its own list."""
    _aged(pki, timedelta(days=10))
    crl, new = pki.revoke(OTHER)
    assert new and not crl.expired()


def test_refresh_crl_command_without_etcd(pki: LocalPki, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TIERMESH_ETCD", raising=False)
    old = _aged(pki, timedelta(days=1))
    assert main(["pki", "refresh-crl", "--home", str(pki.paths.root.parent)]) == EXIT_OK
    assert pki.crl().number == old.number + 1 and not pki.crl().expired()
    assert "not published" in capsys.readouterr().err


async def test_the_refresher_re_signs_a_list_older_than_its_period_and_only_then(pki: LocalPki) -> None:
    """What `tiermesh up` runs (it holds the CA): a home left alone re-signs at once, then every period."""
    old = _aged(pki, timedelta(hours=7))
    async with CrlRefresher(pki, None, every=timedelta(hours=6)) as refresher:
        for _ in range(100):
            if refresher.refreshed:
                break
            await asyncio.sleep(0.02)
        assert refresher.refreshed == 1
        fresh = pki.crl()
        assert fresh.number == old.number + 1 and fresh.next_update is not None
        assert fresh.next_update > datetime.now(UTC) + CRL_LIFETIME - timedelta(minutes=1)
        await asyncio.sleep(0.2)
        assert refresher.refreshed == 1  # not due again for six hours
    async with CrlRefresher(pki, None, every=timedelta(seconds=1)) as fast:
        await asyncio.sleep(2.6)
    assert fast.refreshed >= 1 and pki.crl().number > fresh.number
