"""CURVE between sites, bound to the mesh CA, over real ZeroMQ on 127.0.0.1: who gets served, as whom, and
what a refused or garbage-sending peer costs the server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.asyncio

from mesh.errors import DeadlineExceeded, PeerUnavailable, PermissionDenied, Unauthenticated
from mesh.pki.curve import CurveKeyPair
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq.client import ZmqClient
from mesh.zmq.curve import CurveSecurity
from mesh.zmq.server import ZmqServer, current_peer
from mesh.zmq.site_keys import SiteKeys
from tests.helpers.site_certs import published_certs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

EDGE, CORE = Identity("site", "edge-a"), Identity("site", "core")


def make_req(*, deadline_s: float = 1.5, hops: list[str] | None = None, tenant: str = "acme") -> InferRequest:
    return InferRequest(task="echo", inputs={"x": np.ones(4, np.float32)}, slo=SLO(1000.0), tenant=tenant,
                        deadline=time.monotonic() + deadline_s, hops=["edge-a"] if hops is None else hops)


async def echo_peer(req: InferRequest) -> InferResponse:
    """Echoes, and says in ``variant`` which authenticated site sent the request."""
    return InferResponse(request_id=req.request_id, outputs=dict(req.inputs), site="core",
                         variant=current_peer() or "-", accuracy=1.0, reason="local_ok", tenant=req.tenant,
                         hops=[*req.hops, "core"])


@dataclass
class Mesh:
    pki: LocalPki
    keys: SiteKeys
    server: ZmqServer
    security: CurveSecurity

    @property
    def server_key(self) -> bytes:
        return self.pki.curve(CORE).public

    def client(self, keys: CurveKeyPair | None) -> ZmqClient:
        if keys is None:
            return ZmqClient()
        return ZmqClient(security=CurveSecurity(keys, self.keys), server_key_for=lambda _ep, _lost: self.server_key)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    pki = LocalPki.under(tmp_path)
    pki.init()
    for site in (EDGE, CORE):
        pki.issue(site)
    keys = SiteKeys(pki.paths, site=CORE.name, interval_s=0.2)  # the core's own certificate from its file ...
    keys.publish(published_certs(pki))  # ... its peers' as etcd delivers them
    security = CurveSecurity(pki.curve(CORE), keys)
    async with keys, ZmqServer(echo_peer, security=security) as server:
        yield Mesh(pki, keys, server, security)


async def wait_for(cond: Callable[[], bool], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    for _ in range(int(within_s / 0.05) + 1):  # bounded poll of a counter nothing signals
        if cond() or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.05)


async def assert_refused(client: ZmqClient, endpoint: str) -> None:
    with pytest.raises((PeerUnavailable, DeadlineExceeded)):
        await client.request(endpoint, make_req())


async def test_an_authenticated_site_is_served_as_itself(mesh: Mesh) -> None:
    async with mesh.client(mesh.pki.curve(EDGE)) as client:
        resp = await client.request(mesh.server.endpoint, make_req(deadline_s=5.0))
    assert resp.variant == "edge-a"  # the ZAP User-Id, seen by the handler
    assert resp.outputs["x"].tolist() == [1.0] * 4


async def test_a_plain_zeromq_peer_gets_nothing_and_others_are_still_served(mesh: Mesh) -> None:
    async with mesh.client(None) as plain, mesh.client(mesh.pki.curve(EDGE)) as good:
        await assert_refused(plain, mesh.server.endpoint)
        assert (await good.request(mesh.server.endpoint, make_req(deadline_s=5.0))).variant == "edge-a"


async def test_a_curve_key_bound_to_no_certificate_is_refused(mesh: Mesh) -> None:
    async with mesh.client(CurveKeyPair.generate()) as stranger:
        await assert_refused(stranger, mesh.server.endpoint)
    assert mesh.security.refusals.total >= 1


async def test_a_client_without_the_servers_key_does_not_connect(mesh: Mesh) -> None:
    client = ZmqClient(security=CurveSecurity(mesh.pki.curve(EDGE), mesh.keys), server_key_for=lambda _ep, _lost: None)
    async with client:
        with pytest.raises(PeerUnavailable, match="no CURVE key"):
            await client.request(mesh.server.endpoint, make_req())


async def test_a_revoked_site_is_refused_within_5_s(mesh: Mesh) -> None:
    async with mesh.client(mesh.pki.curve(EDGE)) as client:
        assert (await client.request(mesh.server.endpoint, make_req(deadline_s=5.0))).variant == "edge-a"
        mesh.pki.revoke(EDGE)
        t0 = time.monotonic()
        refused: Exception | None = None
        while time.monotonic() - t0 < 5.0 and refused is None:
            try:
                await client.request(mesh.server.endpoint, make_req())
            except (Unauthenticated, PeerUnavailable) as exc:  # refused per request, or its connection closed
                refused = exc
            await asyncio.sleep(0.1)
        assert refused is not None, "revoked site still served 5 s after the CRL changed"
    async with mesh.client(mesh.pki.curve(EDGE)) as fresh:  # and a new connection fails its handshake
        await assert_refused(fresh, mesh.server.endpoint)
    assert not mesh.keys.admits("edge-a") and mesh.keys.admits("core")


async def test_a_revoked_sites_open_connection_is_closed_within_5_s(mesh: Mesh) -> None:
    """Idle, it sends nothing after the revocation: the server shuts its connection down, and its reconnect
    fails the handshake (its client marks the server unreachable), while another site's connection stays."""
    other = Identity("site", "edge-b")
    mesh.pki.issue(other)
    mesh.keys.publish(published_certs(mesh.pki))
    async with mesh.client(mesh.pki.curve(EDGE)) as revoked, mesh.client(mesh.pki.curve(other)) as kept:
        assert (await revoked.request(mesh.server.endpoint, make_req(deadline_s=5.0))).variant == "edge-a"
        assert (await kept.request(mesh.server.endpoint, make_req(deadline_s=5.0))).variant == "edge-b"
        mesh.pki.revoke(EDGE)
        await wait_for(lambda: mesh.server.endpoint in revoked.unreachable(), 5.0)
        assert mesh.server.endpoint in revoked.unreachable(), "the revoked site's connection is still open"
        assert mesh.server.endpoint not in kept.unreachable()
        assert (await kept.request(mesh.server.endpoint, make_req(deadline_s=5.0))).variant == "edge-b"


async def test_a_re_issued_site_is_admitted_with_its_new_key(mesh: Mesh) -> None:
    mesh.keys.rotation_grace_s = 1.0
    old = mesh.pki.curve(EDGE)
    mesh.pki.issue(EDGE)
    new = mesh.pki.curve(EDGE)
    assert old.public != new.public
    mesh.keys.publish(published_certs(mesh.pki))  # the re-issued certificate, as the edge publishes it
    async with mesh.client(new) as client:
        assert (await client.request(mesh.server.endpoint, make_req(deadline_s=5.0))).variant == "edge-a"
    # rotated, not revoked: the previous key still gets through for the grace period (while the site takes
    # its new key) ...
    assert mesh.keys.previous_key("edge-a") == old.public
    async with mesh.client(old) as during:
        assert (await during.request(mesh.server.endpoint, make_req(deadline_s=5.0))).variant == "edge-a"
    # ... and not after it
    await asyncio.sleep(1.1)
    mesh.keys.refresh(force=True)
    assert mesh.keys.previous_key("edge-a") is None
    async with mesh.client(old) as stale:
        await assert_refused(stale, mesh.server.endpoint)
    async with mesh.client(new) as client:
        assert (await client.request(mesh.server.endpoint, make_req(deadline_s=5.0))).variant == "edge-a"


async def test_a_server_rebinds_with_its_re_issued_key(mesh: Mesh) -> None:
    """The site's own certificate re-issued: the server takes the new pair on the same endpoint (no restart);
    peers dialling the new key are served, the old key no longer answers."""
    endpoint = mesh.server.endpoint
    old = mesh.pki.curve(CORE)
    mesh.pki.issue(CORE)
    new = mesh.pki.curve(CORE)
    mesh.keys.refresh()
    mesh.security.keys = new
    await mesh.server.rebind()
    assert mesh.server.endpoint == endpoint
    client = ZmqClient(security=CurveSecurity(mesh.pki.curve(EDGE), mesh.keys),
                       server_key_for=lambda _ep, _lost: new.public)
    async with client:
        assert (await client.request(endpoint, make_req(deadline_s=5.0))).variant == "edge-a"
    stale = ZmqClient(security=CurveSecurity(mesh.pki.curve(EDGE), mesh.keys),
                      server_key_for=lambda _ep, _lost: old.public)
    async with stale:
        await assert_refused(stale, endpoint)


async def test_a_flood_of_garbage_gets_bounded_warnings(mesh: Mesh, caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    edge = mesh.pki.curve(EDGE)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.CURVE_SERVERKEY, mesh.server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, edge.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, edge.secret)
        sock.connect(mesh.server.endpoint)
        with caplog.at_level(logging.WARNING, logger="mesh.zmq"):
            for i in range(500):
                await sock.send_multipart([b"\xc1garbage", str(i).encode()])
            await wait_for(lambda: mesh.server.garbage.total >= 500, 10.0)
        assert mesh.server.garbage.total == 500
        warnings = [r for r in caplog.records if "bad request frames" in r.getMessage()]
        assert 1 <= len(warnings) <= 2 and mesh.server.garbage.logged <= 2
        async with mesh.client(edge) as good:  # and the server still serves
            assert (await good.request(mesh.server.endpoint, make_req(deadline_s=5.0))).variant == "edge-a"
    finally:
        sock.close(linger=0)
        ctx.term()


async def test_header_claims_are_trusted_only_from_an_authenticated_site(mesh: Mesh) -> None:
    from edge_agent.site_dataplane import check_sender

    async def checked(req: InferRequest) -> InferResponse:
        check_sender(req, current_peer(), secured=True)
        return await echo_peer(req)

    async with ZmqServer(checked, security=CurveSecurity(mesh.pki.curve(CORE), mesh.keys)) as secured, \
            ZmqServer(checked) as open_server, mesh.client(mesh.pki.curve(EDGE)) as client, \
            mesh.client(None) as plain:
        ok = await client.request(secured.endpoint, make_req(deadline_s=5.0, hops=["edge-a"], tenant="other"))
        assert ok.tenant == "other" and ok.variant == "edge-a"
        with pytest.raises(PermissionDenied, match="claims hops"):  # edge-a posing as another forwarder
            await client.request(secured.endpoint, make_req(deadline_s=5.0, hops=["edge-b"]))
        with pytest.raises(Unauthenticated, match="not an authenticated site"):  # no CURVE at all
            await plain.request(open_server.endpoint, make_req(deadline_s=5.0))


def test_site_keys_admit_only_valid_site_certificates_under_their_own_name(mesh: Mesh) -> None:
    tenant, stranger = Identity("tenant", "acme"), Identity("site", "edge-z")
    mesh.pki.issue(tenant)
    other_ca = LocalPki.under(mesh.pki.paths.root.parent / "other")
    other_ca.init()
    other_ca.issue(stranger)
    published = published_certs(mesh.pki)
    # what a hostile etcd (or a compromised site's writes) could deliver: a tenant's certificate as a site, a site's
    # certificate under another site's name, another CA's site, our own name with someone else's certificate, junk
    published |= {"impostor": mesh.pki.paths.cert(tenant).read_bytes(),
                  "edge-b": mesh.pki.paths.cert(EDGE).read_bytes(),
                  "edge-z": other_ca.paths.cert(stranger).read_bytes(),
                  "core": mesh.pki.paths.cert(EDGE).read_bytes(),
                  "junk": b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"}
    assert mesh.keys.publish(published)
    assert mesh.keys.sites() == ["core", "edge-a"]
    assert mesh.keys.key_of("edge-a") == mesh.pki.curve(EDGE).public
    assert mesh.keys.key_of("core") == mesh.pki.curve(CORE).public  # its own from its file, never from etcd
    assert mesh.keys.site_of(bytes(32)) is None
    for name in ("impostor", "edge-b", "edge-z", "junk"):
        assert mesh.keys.refuses(name), name
    assert "certificate of edge-a" in (mesh.keys.refusal("edge-b") or "")
    assert not mesh.keys.publish(published)  # the same delivery again: nothing re-read


def test_site_keys_refuse_a_site_the_topology_does_not_name_and_bind_its_addresses(tmp_path: Path) -> None:
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(CORE)
    pki.issue(EDGE, addresses=["10.9.0.2", "edge-a.example"])
    pki.issue(Identity("site", "edge-b"))  # names no address: bound to none
    known = {"core", "edge-a"}
    keys = SiteKeys(pki.paths, site=CORE.name, known=lambda: known)
    keys.publish(published_certs(pki))
    assert keys.sites() == ["core", "edge-a"] and "not a site of the topology" in (keys.refusal("edge-b") or "")
    assert keys.names_host("edge-a", "10.9.0.2") and keys.names_host("edge-a", "EDGE-A.example.")
    assert not keys.names_host("edge-a", "10.9.0.3") and not keys.names_host("edge-a", "other.example")
    known.add("edge-b")  # the topology grew: read again
    assert keys.refresh() and keys.admits("edge-b")
    assert keys.names_host("edge-b", "10.1.1.1") and keys.names_host("edge-b", "anything.example")
    assert not keys.names_host("nobody", "10.9.0.2")


async def test_a_site_refused_before_its_certificate_arrived_gets_through_once_it_has(tmp_path: Path) -> None:
    """libzmq never reconnects a session whose handshake failed: a site that dialled a peer before its certificate
    reached that peer (through etcd) was refused once and then routed around it for good. The client dials such a
    probe again (backing off), so it gets through once the peer holds the certificate."""
    pki = LocalPki.under(tmp_path)
    pki.init()
    for site in (EDGE, CORE):
        pki.issue(site)
    server_keys = SiteKeys(pki.paths, site=CORE.name)  # nothing delivered yet: the edge's key is unknown
    client = ZmqClient(security=CurveSecurity(pki.curve(EDGE), SiteKeys(pki.paths, site=EDGE.name)),
                       server_key_for=lambda _ep, _lost: pki.curve(CORE).public)
    async with ZmqServer(echo_peer, security=CurveSecurity(pki.curve(CORE), server_keys)) as server, client:
        client.connect(server.endpoint)
        await wait_for(lambda: server.endpoint in client.unreachable(), 5.0)
        assert server.endpoint in client.unreachable(), "the first handshake was not refused"
        await asyncio.sleep(1.0)  # refused again meanwhile: libzmq alone would not try any more
        server_keys.publish(published_certs(pki))  # the edge's certificate arrives
        await wait_for(lambda: server.endpoint not in client.unreachable(), 10.0)
        assert server.endpoint not in client.unreachable(), "never dialled again"
        assert (await client.request(server.endpoint, make_req(deadline_s=5.0))).variant == "edge-a"
