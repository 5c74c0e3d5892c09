"""The CRL follower on a real etcd: lists published at ``pki/crl`` are verified against the CA, adopted only when
newer, written atomically where etcd's ``--client-crl-file`` reads them, and a list that revokes something new
runs the bound on open connections once; bad values are logged and the list in force is kept. ``ss -K`` resets
real loopback connections (as root)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from mesh.etcd.keys import PKI_CRL
from mesh.etcd.store import Store
from mesh.pki.crl import RevocationList, crl_record
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.helpers.waiting import eventually
from tiermesh.crl_follow import CrlFollower, drop_connections
from tiermesh.pki_etcd import publish_crl

pytestmark = pytest.mark.integration
ACME, GLOBEX = Identity("tenant", "acme"), Identity("tenant", "globex")


@pytest.fixture
def pki(tmp_path: Path) -> LocalPki:
    pki = LocalPki.under(tmp_path / "op")
    pki.init()
    for who in (ACME, GLOBEX):
        pki.issue(who)
    return pki


async def test_follows_verifies_writes_and_bounds_once(store: Store, pki: LocalPki, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "etcd" / "crl.pem"
    out.parent.mkdir()
    first = pki.crl()
    out.write_bytes(first.to_pem())  # the list etcd started with (number 1)
    runs: list[tuple[int, frozenset[int]]] = []
    adopted: list[int] = []

    async def bound(crl: RevocationList, serials: frozenset[int]) -> None:
        runs.append((crl.number, serials))

    follower = CrlFollower(store, pki.paths.ca_cert, out, on_revoked=bound,
                           on_adopted=lambda c: adopted.append(c.number))
    assert follower.crl is not None and follower.crl.number == 1  # read from the file it keeps
    async with follower:
        acme = pki.certificate(ACME).serial_number
        crl2, _ = pki.revoke(ACME)
        assert (await publish_crl(store, crl2, pki.ca().cert))[0]

        async def at(number: int) -> bool:
            return RevocationList.load(out.read_bytes(), pki.ca().cert).number == number

        await eventually(lambda: at(2), 5, "list 2 written")
        await eventually(_true(lambda: runs == [(2, frozenset({acme}))]), 5, "the bound runs for acme's serial")

        # bad values: garbage, a list from another CA, an older list; each logged, list 2 kept, no bound
        await store.put(PKI_CRL, {"schema": 1, "pem": "not a list"})
        other = LocalPki.under(tmp_path / "other")
        other.init()
        await store.put(PKI_CRL, crl_record(RevocationList.sign(other.ca(), [], number=9)))
        await store.put(PKI_CRL, crl_record(first))
        await store.put(PKI_CRL, crl_record(crl2))  # the same number again
        await store.delete(PKI_CRL)
        # a newer list that revokes nothing new (re-signed, number 3): adopted, no bound
        same = RevocationList.sign(pki.ca(), [replace(e, identity=None) for e in crl2.entries], number=3)
        await store.put(PKI_CRL, crl_record(same))
        await eventually(lambda: at(3), 5, "list 3 written")
        refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refusing the revocation")]
        assert len(refused) == 2 and "unreadable" in refused[0] and "not signed by the mesh CA" in refused[1]
        assert any("no list at pki/crl in etcd (none published yet, or deleted); keeping list 2" in r.getMessage()
               for r in caplog.records)
        # then globex: the bound runs again, for globex's serial alone
        crl4 = RevocationList.sign(pki.ca(), [*same.entries, *pki.revoke(GLOBEX)[0].entries], number=4)
        await store.put(PKI_CRL, crl_record(crl4))
        glob = pki.certificate(GLOBEX).serial_number
        await eventually(_true(lambda: len(runs) == 2), 5, "the bound runs for globex")
        assert runs[1] == (4, frozenset({glob}))
        assert adopted == [2, 3, 4] and follower.adopted == 3 and follower.bounds == 2
        assert follower.connected

    # started again on the file it wrote: list 4 is known, nothing is bounded twice
    runs.clear()
    async with CrlFollower(store, pki.paths.ca_cert, out, on_revoked=bound) as again:
        assert again.crl is not None and again.crl.number == 4
        await asyncio.sleep(0.5)
        assert runs == [] and again.adopted == 0


async def test_a_follower_with_no_list_adopts_without_bounding(store: Store, pki: LocalPki, tmp_path: Path) -> None:
    crl, _ = pki.revoke(ACME)
    await publish_crl(store, crl, pki.ca().cert)
    runs: list[int] = []

    async def bound(crl: RevocationList, serials: frozenset[int]) -> None:
        runs.append(crl.number)

    out = tmp_path / "fresh" / "crl.pem"
    async with CrlFollower(store, pki.paths.ca_cert, out, on_revoked=bound) as follower:
        await eventually(_true(lambda: out.exists()), 5, "the list is written")
        assert follower.crl is not None and follower.crl.number == 2
        await asyncio.sleep(0.3)
        assert runs == []  # no list before: no server admitted anyone it should have refused since


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ss") is None,
                    reason="ss -K needs root (CAP_NET_ADMIN) and iproute2's ss")
async def test_drop_connections_resets_established_connections_to_a_port(pki: LocalPki) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with listener, socket.create_connection(("127.0.0.1", port)) as client, \
            socket.create_connection(("127.0.0.1", port)) as second:
        accepted = [listener.accept()[0], listener.accept()[0]]
        try:
            await drop_connections(port)(pki.crl(), frozenset())
            for c in (client, second):
                c.settimeout(2.0)  # reset: an error at once; left open: a timeout, not a hang
                with pytest.raises(ConnectionResetError):
                    c.send(b"x")
                    c.recv(1)
        finally:
            for a in accepted:
                a.close()


def _true(pred: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return pred()

    return check


async def test_a_refused_list_is_tried_again_until_it_verifies(store: Store, pki: LocalPki, tmp_path: Path) -> None:
    """A list refused once (here: the CA file beside the follower is not yet the CA that signed it, as when a CA is
    replaced on disk a moment after its first list arrives) is adopted once it verifies, with no new write to
    ``pki/crl``: the watch delivers a value once, and the refusal used to stand until the next list."""
    ca_file = tmp_path / "follower-ca.pem"
    other = LocalPki.under(tmp_path / "other")
    other.init()
    shutil.copyfile(other.paths.ca_cert, ca_file)  # not the CA of the lists published
    out = tmp_path / "etcd-crl.pem"
    crl, _ = pki.revoke(ACME)
    assert (await publish_crl(store, crl, pki.ca().cert))[0]
    async with CrlFollower(store, ca_file, out) as follower:
        await asyncio.sleep(0.5)
        assert follower.crl is None and not out.exists()  # refused: another CA
        shutil.copyfile(pki.paths.ca_cert, ca_file)  # the right CA arrives; etcd's value does not change

        async def adopted() -> bool:
            return follower.crl is not None and follower.crl.number == crl.number

        await eventually(adopted, timeout=8, what="the refused list adopted once it verifies")
        assert RevocationList.load(out.read_bytes(), pki.ca().cert).is_revoked(pki.certificate(ACME).serial_number)
