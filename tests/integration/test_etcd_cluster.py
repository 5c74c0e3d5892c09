"""The store on a real 3-member etcd cluster: the leader member dies (SIGKILL) and requests, a watch
and a lease carry on through the other two; and etcd with TLS and client-certificate auth."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mesh.errors import StoreUnavailable
from mesh.etcd.cluster import EtcdCluster
from mesh.etcd.server import EmbeddedEtcd, ServerTLS
from mesh.etcd.store import Store
from tests.helpers.certs import TestPKI, make_pki
from tests.helpers.waiting import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[EtcdCluster]:
    c = EtcdCluster(tmp_path / "cluster", size=3, unsafe_no_fsync=True)
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


async def test_leader_death_is_survived(cluster: EtcdCluster) -> None:
    lead = await cluster.leader()
    # the leader first: the store starts on the member about to die
    urls = [cluster.urls[lead]] + [u for i, u in enumerate(cluster.urls) if i != lead]
    async with await Store.connect(",".join(urls), prefix="/fail/") as store:
        assert store.member == urls[0].split("://")[1]
        lease = await store.lease(4)
        await store.put("live/me", {"up": True}, lease=lease)
        async with store.watch_prefix("w/") as watch:
            await store.put("w/before", 1)
            first = await asyncio.wait_for(anext(watch), 5)
            t_kill = time.monotonic()
            await cluster.kill(lead)

            # within a few seconds: a put lands and is read back through another member
            async def put_and_get() -> bool:
                try:
                    await store.put("w/after", 2)
                    got = await store.get("w/after")
                except StoreUnavailable:
                    return False
                return got is not None and got.value == 2
            await eventually(put_and_get, 10, "a put and get after the leader died")
            recovered_s = time.monotonic() - t_kill
            assert store.member != urls[0].split("://")[1]
            # the watch resumes on another member from the last revision + 1: nothing missed or repeated
            second = await asyncio.wait_for(anext(watch), 10)
            assert (first.key, second.key) == ("w/before", "w/after") and second.revision > first.revision
        # the lease is kept alive through the election (etcd renews leases when a new leader takes over)
        await asyncio.sleep(lease.ttl + 1.0)
        held = await store.get("live/me")
        assert lease.alive and held is not None and held.lease == lease.id
        assert recovered_s < 10
        new_lead = await cluster.leader()
        assert new_lead != lead
    # the dead member comes back on its data, rejoins and catches up with what it missed
    await cluster.restart(lead)
    async with await Store.connect(cluster.urls[lead], prefix="/fail/") as alone:
        got = await alone.get("w/after")
        assert got is not None and got.value == 2


async def test_connect_skips_a_dead_member(cluster: EtcdCluster) -> None:
    await cluster.kill(0)
    t0 = time.monotonic()
    async with await Store.connect(cluster.urls, prefix="/skip/", timeout=8.0) as store:
        # a live member (the first may still be electing a leader: then the next one)
        assert store.member in {u.split("://")[1] for u in cluster.urls[1:]}
        await store.put("k", "v")
        assert (await store.get("k")) is not None
    assert time.monotonic() - t0 < 15


# -- TLS -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def tls_etcd(tmp_path: Path, pki: TestPKI) -> AsyncIterator[EmbeddedEtcd]:
    srv = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True,
                       tls=ServerTLS(pki.server_cert, pki.server_key, pki.ca, client_cert_auth=True))
    try:
        await srv.start()
        yield srv
    finally:
        await srv.stop()


async def test_tls_with_client_certificate(tls_etcd: EmbeddedEtcd, pki: TestPKI) -> None:
    assert tls_etcd.url.startswith("https://")
    async with await Store.connect(tls_etcd.url, prefix="/tls/", ca=pki.ca, cert=pki.client_cert,
                                   key=pki.client_key) as store:
        await store.put("k", {"secret": 1})
        got = await store.get("k")
        assert got is not None and got.value == {"secret": 1}
        async with store.watch_prefix("") as watch:
            await store.put("k", {"secret": 2})
            ev = await asyncio.wait_for(anext(watch), 5)
            assert ev.value == {"secret": 2}


async def test_tls_without_client_certificate_is_refused(tls_etcd: EmbeddedEtcd, pki: TestPKI) -> None:
    with pytest.raises(StoreUnavailable, match="TLS"):
        await Store.connect(tls_etcd.url, prefix="/tls/", ca=pki.ca, timeout=3.0)
    # the wrong CA: the client does not trust the member
    with pytest.raises(StoreUnavailable, match="TLS"):
        await Store.connect(tls_etcd.url, prefix="/tls/", ca=pki.other_ca, cert=pki.client_cert,
                            key=pki.client_key, timeout=3.0)
    # plain gRPC to a TLS port
    with pytest.raises(StoreUnavailable, match="TLS"):
        await Store.connect(tls_etcd.url.replace("https://", "http://"), prefix="/tls/", timeout=3.0)
