"""etcd given the mesh CA's revocation list (``--client-crl-file``), on a real etcd with TLS and client-certificate
auth: once a certificate is revoked and the file rewritten in place, that certificate's next connection is refused
while every other identity still connects (no restart). Before lists dropped tiermesh's private entry extension,
Go's parser refused the whole list ("asn1: base 128 integer too large") and etcd refused *every* client once one
certificate had been revoked; this test fails that way with such a list."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mesh.errors import StoreError
from mesh.etcd.server import EmbeddedEtcd, ServerTLS
from mesh.etcd.store import Store
from mesh.pki.files import write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki

pytestmark = pytest.mark.integration
SERVER = Identity("etcd", "etcd")
REVOKED, KEPT = Identity("site", "edge-1"), Identity("admin", "op")


@pytest.fixture
async def crl_etcd(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedEtcd, LocalPki, Path]]:
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(SERVER, addresses=["127.0.0.1", "localhost"])
    for who in (REVOKED, KEPT):
        pki.issue(who)
    crl_file = tmp_path / "etcd-crl.pem"  # etcd's own copy, as a follower keeps it
    write_file(crl_file, pki.paths.crl.read_bytes())
    srv = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True,
                       tls=ServerTLS(pki.paths.cert(SERVER), pki.paths.key(SERVER), pki.paths.ca_cert,
                                     crl_file=crl_file))
    try:
        await srv.start()
        yield srv, pki, crl_file
    finally:
        await srv.stop()


async def _connect(srv: EmbeddedEtcd, pki: LocalPki, who: Identity) -> Store:
    return await Store.connect(srv.url, "/crl/", ca=pki.paths.ca_cert, cert=pki.paths.cert(who),
                               key=pki.paths.key(who), timeout=3.0)


async def test_a_revoked_certificate_is_refused_and_the_others_are_not(
        crl_etcd: tuple[EmbeddedEtcd, LocalPki, Path]) -> None:
    srv, pki, crl_file = crl_etcd
    async with await _connect(srv, pki, REVOKED) as before:
        await before.put("k", {"v": 1})
    pki.revoke(REVOKED, reason="key_compromise")
    write_file(crl_file, pki.paths.crl.read_bytes())  # rewritten in place: etcd re-reads it per handshake
    with pytest.raises(StoreError):
        await _connect(srv, pki, REVOKED)
    async with await _connect(srv, pki, KEPT) as other:  # the list parses: everyone else still connects
        got = await other.get("k")
        assert got is not None and got.value == {"v": 1}
