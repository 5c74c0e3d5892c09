"""Issue 11, rotation: two sites re-key their CURVE listener at the same instant while an edge has requests in
flight to both, over real ZeroMQ CURVE sockets on 127.0.0.1. Re-binding drops every connection to them and
answers none of what was in flight (``drain_s=0``: the worst case); the edge learns each new key a little later,
as from a live record (one through ``redial``, as the agent does on a view change; the other only through its
probe asking for the key again). Nothing may fail: what was pending is re-sent over the new connections. And
the wait is bounded: a peer that never comes back fails its requests with time left for another site."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from mesh.errors import PeerUnavailable
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq.base import DEFAULT_HEARTBEAT
from mesh.zmq.client import ZmqClient
from mesh.zmq.curve import CurveSecurity
from mesh.zmq.server import ZmqServer, current_peer
from mesh.zmq.site_keys import SiteKeys
from tests.helpers.site_certs import published_certs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

EDGE, CORE, MID = Identity("site", "edge-a"), Identity("site", "core"), Identity("site", "mid")
SERVE_S = 0.15  # every request is in flight this long at its server
NOISE_S = 1.0   # a shared 2-core machine


async def slow_echo(req: InferRequest) -> InferResponse:
    await asyncio.sleep(SERVE_S)
    return InferResponse(request_id=req.request_id, outputs=dict(req.inputs), site="x",
                         variant=current_peer() or "-", accuracy=1.0, reason="local_ok", tenant=req.tenant,
                         hops=[*req.hops, "x"])


def make_req(deadline_s: float, n: float = 1.0) -> InferRequest:
    return InferRequest(task="echo", inputs={"x": np.full(4, n, np.float32)}, slo=SLO(1000.0), tenant="acme",
                        deadline=time.monotonic() + deadline_s, hops=["edge-a"])


@dataclass
class Sites:
    pki: LocalPki
    keys: SiteKeys
    servers: dict[Identity, tuple[ZmqServer, CurveSecurity]]
    published: dict[str, bytes]  # endpoint -> the key its "live record" publishes
    client: ZmqClient

    def endpoint(self, who: Identity) -> str:
        return self.servers[who][0].endpoint

    async def rekey_both(self) -> dict[Identity, bytes]:
        """Re-issue CORE's and MID's certificates and re-bind both listeners at once; returns the new keys
        (not yet published)."""
        new = {}
        for who in (CORE, MID):
            self.pki.issue(who)
            new[who] = self.pki.curve(who).public
        self.keys.publish(published_certs(self.pki))  # each publishes its re-issued certificate in etcd
        for who in (CORE, MID):
            self.servers[who][1].keys = self.pki.curve(who)
        await asyncio.gather(*(self.servers[w][0].rebind(drain_s=0.0) for w in (CORE, MID)))
        return new


@pytest.fixture
async def sites(tmp_path: Path) -> AsyncIterator[Sites]:
    pki = LocalPki.under(tmp_path)
    pki.init()
    for who in (EDGE, CORE, MID):
        pki.issue(who)
    keys = SiteKeys(pki.paths, interval_s=0.2)
    keys.publish(published_certs(pki))  # every site's certificate, as etcd delivers them
    servers: dict[Identity, tuple[ZmqServer, CurveSecurity]] = {}
    async with keys:
        try:
            for who in (CORE, MID):
                security = CurveSecurity(pki.curve(who), keys)
                server = ZmqServer(slow_echo, security=security)
                await server.start()
                servers[who] = (server, security)
            published = {servers[w][0].endpoint: pki.curve(w).public for w in (CORE, MID)}
            client = ZmqClient(security=CurveSecurity(pki.curve(EDGE), keys),
                               server_key_for=lambda ep, _lost: published.get(ep))
            async with client:
                yield Sites(pki, keys, servers, published, client)
        finally:
            for server, _ in servers.values():
                await server.stop()


async def _in_flight(sites: Sites, n: int, **kw: float) -> list[asyncio.Task[InferResponse]]:
    tasks = [asyncio.create_task(sites.client.request(sites.endpoint(w), make_req(3.0, float(i)), **kw))
             for i in range(n) for w in (CORE, MID)]
    deadline = time.monotonic() + 5.0
    while sum(s.inflight for s, _ in sites.servers.values()) < 2 * n:  # bounded: 5 s
        assert time.monotonic() < deadline, "the requests never reached their servers"
        await asyncio.sleep(0.01)
    return tasks


async def test_two_sites_re_keyed_at_once_lose_no_request_in_flight(sites: Sites) -> None:
    # each send may go unanswered 400 ms only: longer than a reply takes, shorter than the re-key takes from
    # the first send, so this also says the attempt's limit restarts when the request is re-sent
    tasks = await _in_flight(sites, 8, attempt_ms=400.0)
    new = await sites.rekey_both()  # both listeners re-bound: every connection dropped, nothing answered
    await asyncio.sleep(0.3)        # the new keys reach the edge later, as through etcd
    core, mid = sites.endpoint(CORE), sites.endpoint(MID)
    sites.published[core], sites.published[mid] = new[CORE], new[MID]
    sites.client.redial(core, "its CURVE key changed")  # the agent's view change; MID is left to its probe
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    assert {r.variant for r in results if isinstance(r, InferResponse)} == {"edge-a"}
    assert sorted(float(r.outputs["x"][0]) for r in results if isinstance(r, InferResponse)) == \
        sorted(float(i) for i in range(8) for _ in (CORE, MID))
    # and both serve afresh over the new key
    for ep in (core, mid):
        assert (await sites.client.request(ep, make_req(3.0))).variant == "edge-a"
    assert sites.client.unreachable() == {}


async def test_a_peer_that_does_not_come_back_fails_its_requests_with_time_left(sites: Sites) -> None:
    tasks = await _in_flight(sites, 3)
    t0 = time.monotonic()
    for server, _ in sites.servers.values():
        await server.stop()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    waited = time.monotonic() - t0
    assert all(isinstance(r, PeerUnavailable) for r in results), results
    # at most redial_ms (and half the 3 s budget), not the deadline: time left to try another site
    assert waited < DEFAULT_HEARTBEAT.redial_ms / 1000.0 + NOISE_S, waited


async def test_a_re_keyed_peer_is_redialled_with_its_certificate_key_before_its_live_record_says_so(
        sites: Sites) -> None:
    """The edge already holds the peers' re-issued certificates but their live records still publish the old
    keys (etcd and the view are slower): a connection lost with the old key is re-dialled with the key the
    certificate binds at the next reconnect, so what was in flight comes back well within the redial wait,
    with no ``redial`` from a view change and no new key published."""
    old = dict(sites.published)
    bound: dict[str, bytes] = {}

    def lookup(endpoint: str, lost: bytes | None) -> bytes | None:  # as edge_agent.peer_keys: published first,
        keys = [old[endpoint], *([bound[endpoint]] if endpoint in bound else [])]  # then the certificate's
        return next((k for k in keys if k != lost), keys[0])

    sites.client._server_key_for = lookup  # the fixture's client, with the agent's rule
    tasks = await _in_flight(sites, 4, attempt_ms=400.0)
    t0 = time.monotonic()
    new = await sites.rekey_both()
    for who in (CORE, MID):
        bound[sites.endpoint(who)] = new[who]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    waited = time.monotonic() - t0
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    # re-sent over a connection with the new key; a request held past the redial wait would have failed
    assert waited < DEFAULT_HEARTBEAT.redial_ms / 1000.0, waited
    assert sites.client.unreachable() == {}
    assert sites.published == old  # nothing was published: the certificate's key did it


async def test_a_client_re_keyed_after_publishing_is_admitted_at_its_first_handshake(tmp_path: Path) -> None:
    """The server polls its files only every 60 s here: a peer that published its re-issued certificate and then
    took its key is admitted at its first handshake, because a delivered certificate is believed at once (the
    agent publishes before it re-keys: edge_agent.agent_trust.REKEY_PUBLISH_LEAD_S)."""
    pki = LocalPki.under(tmp_path)
    pki.init()
    for who in (EDGE, CORE):
        pki.issue(who)
    server_keys = SiteKeys(pki.paths, site=CORE.name, interval_s=60.0)
    client_keys = SiteKeys(pki.paths, site=EDGE.name, interval_s=60.0)
    server_keys.publish(published_certs(pki))
    server = ZmqServer(slow_echo, security=CurveSecurity(pki.curve(CORE), server_keys))
    await server.start()
    try:
        pki.issue(EDGE)  # the edge re-issued ...
        assert server_keys.key_of("edge-a") != pki.curve(EDGE).public
        server_keys.publish(published_certs(pki))  # ... and published it: etcd delivers it to the core
        async with ZmqClient(security=CurveSecurity(pki.curve(EDGE), client_keys),
                             server_key_for=lambda _ep, _lost: pki.curve(CORE).public) as client:
            resp = await client.request(server.endpoint, make_req(3.0))
        assert resp.variant == "edge-a"
        assert server_keys.key_of("edge-a") == pki.curve(EDGE).public
    finally:
        await server.stop()


async def test_dropping_idle_sockets_at_a_re_key_keeps_probing_an_unreachable_peer(sites: Sites) -> None:
    """A site taking its new key drops its idle client sockets so the next ones carry it. A peer marked
    unreachable has only its probe, idle too: that one must stay, or the mark is never lifted (a request to a
    marked peer fails at once, unsent)."""
    mid = sites.endpoint(MID)
    assert (await sites.client.request(mid, make_req(3.0))).variant == "edge-a"
    server, security = sites.servers[MID]
    await server.stop()
    deadline = time.monotonic() + 5.0
    while mid not in sites.client.unreachable():  # bounded: 5 s
        assert time.monotonic() < deadline, "the stopped peer was never marked unreachable"
        await asyncio.sleep(0.02)
    sites.client.drop_idle()
    back = ZmqServer(slow_echo, bind=mid, security=security)
    await back.start()
    sites.servers[MID] = (back, security)  # the fixture stops this one
    while mid in sites.client.unreachable():  # bounded: 5 s
        assert time.monotonic() < deadline + 5.0, "the probe was dropped: the mark is never lifted"
        await asyncio.sleep(0.02)
    assert (await sites.client.request(mid, make_req(3.0))).variant == "edge-a"
