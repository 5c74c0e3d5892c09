"""A running mesh renews its certificates (tiermesh.cert_renew): one past half its lifetime is re-issued in place
at the next round, one with more left is kept, and a round that fails leaves the next one to try again."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from mesh.pki.files import read_cert
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tiermesh.cert_renew import CertRenewer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ACME = Identity("tenant", "acme")


def _serial(pki: LocalPki) -> int:
    return int(read_cert(pki.paths.cert(ACME)).serial_number)


async def test_a_certificate_past_half_its_life_is_renewed_while_running_and_then_kept(tmp_path: Path) -> None:
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(ACME, lifetime=timedelta(seconds=3))
    short = _serial(pki)
    calls: list[bool] = []

    def renew() -> None:
        if not calls:
            calls.append(False)
            raise OSError("disk full")  # the first round fails: the next one tries again
        calls.append(pki.renew(ACME))

    async with CertRenewer(renew, every_s=0.2) as renewer:
        for _ in range(100):  # bounded: the short certificate passes half its life after 1.5 s
            if _serial(pki) != short:
                break
            await asyncio.sleep(0.1)
        renewed = _serial(pki)
        await asyncio.sleep(0.6)  # more rounds: the fresh certificate has its whole life ahead, kept
        assert renewer.rounds >= 2
    assert renewed != short and _serial(pki) == renewed
    assert calls[0] is False and calls.count(True) == 1
    assert read_cert(pki.paths.cert(ACME)).not_valid_after_utc - read_cert(
        pki.paths.cert(ACME)).not_valid_before_utc > timedelta(hours=1)
