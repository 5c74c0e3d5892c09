"""A compromised site, against real agents (in process, on the session etcd, each with a home of its own holding
its certificate, CURVE key and the CA: CURVE between sites, mutual TLS at the edge). The attacker holds a valid
site identity (``edge-par-1``, a certificate naming no address, as a Kubernetes pod's) and uses it as its own agent
could: it writes its own live record and speaks CURVE with its own key. What it must not be able to do:

* cut another site off by publishing that site's endpoint in its own record;
* make peers or the console fetch a URL of its choosing through its live ``http`` (SSRF);
* send queries as if another door had admitted them, or have the site it forwards to route them again (uncharged);
* spend more of a tenant's quota at the site it forwards to than its own share, or make it load without end.

The pure rules are tabled in ``tests/unit/test_peer_values.py``; the blob fetch's own checks (the server's identity,
the size cap) in ``tests/integration/test_peer_blobs.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from console.scrape import Scraper
from console.state import ConsoleState
from core_scheduler.state.heartbeat import Heartbeat, LoadedVariant
from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.errors import Overloaded, PeerUnavailable, PermissionDenied, RuntimeLoadError, UnknownTask
from mesh.etcd.keys import live_key, site_cert_key
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.published import site_cert_record
from mesh.pki.reload import ReloadingCredentials
from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq.client import ZmqClient
from mesh.zmq.curve import CurveSecurity
from mesh.zmq.site_keys import SiteKeys
from tests.helpers.waiting import eventually
from tests.integration.test_quota_flood import MODEL, SMALL, TASK, _specs
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.blobs import BlobStore
from variant_store.build import signature_from_onnx
from variant_store.catalog import Catalog
from variant_store.meta import VariantMeta

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ATTACKER = Identity("site", "edge-par-1")
OBSERVER = Identity("site", "edge-fra-1")   # an honest site that dials its peers
VICTIM = Identity("site", "mid-eu")         # sorts after the attacker: an agent's view lists the attacker first
VID = "mlp-tiny.onnx.fp32"
COLD = [f"mlp-tiny.cold{i}" for i in range(6)]  # more variants than a peer may have loaded at once
ACME_QPS = 10


@dataclass
class Mesh:
    store: Store
    etcd: EmbeddedEtcd
    tmp: Path
    pki: LocalPki
    digest: str
    agents: list[Agent] = field(default_factory=list)

    def config(self, who: Identity) -> AgentConfig:
        home = self.tmp / who.name
        self.pki.bundle(who, PkiPaths.under(home))  # its own files only, as deployed
        return AgentConfig(site=who.name, etcd=self.etcd.url, prefix=self.store.prefix, home=home,
                           lease_ttl_s=2.0, heartbeat_s=0.5, tls=True)

    def seed(self, who: Identity) -> None:
        """``who`` holds the model's blob already (fetched earlier): it loads without any store."""
        cache = self.tmp / who.name / "sites" / who.name / "blobs"
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"{self.digest}.onnx").write_bytes(MODEL.read_bytes())

    async def attacker_record(self, **values: object) -> None:
        """The attacker's live record, as its own agent may write it (RBAC lets a site write its live key)."""
        hb = Heartbeat(site=ATTACKER.name, ts=time.time(), tier="edge",
                       curve_key=self.pki.curve(ATTACKER).public.decode(), **values)  # type: ignore[arg-type]
        await self.store.put(live_key(ATTACKER.name), hb.to_json())

    def attacker_client(self, server: Agent) -> ZmqClient:
        """A ZeroMQ client speaking CURVE with the attacker's own key, dialling ``server``."""
        assert server.curve is not None
        keys = SiteKeys(self.pki.paths, site=ATTACKER.name)
        target = server.curve.keys.public
        return ZmqClient(security=CurveSecurity(self.pki.curve(ATTACKER), keys),
                         server_key_for=lambda _ep, _lost: target)


def _topology(tmp: Path) -> Path:
    text = SMALL.read_text()
    path = tmp / "topology.yaml"
    path.write_text(text[:text.index("tenants:")] + "tenants:\n  - {name: public, isolation: shared}\n"
                    f"  - {{name: acme, isolation: shared, quotas: {{qps: {ACME_QPS}, max_inflight: 64}}}}\n"
                    "  - {name: globex, isolation: shared}\n")
    return path


@pytest.fixture
async def mesh(store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> AsyncIterator[Mesh]:
    await apply_topology(store, load_topology_file(_topology(tmp_path)))
    blobs = BlobStore(tmp_path / "blobs")  # only for the digest: no variant store runs in these tests
    digest = blobs.put_file(MODEL)
    sig = signature_from_onnx(TASK, MODEL)
    cat = Catalog(store)
    await cat.put_task(sig)
    for vid, owner in [(VID, "public"), ("mlp-tiny.acme-private", "acme"), *((c, "public") for c in COLD)]:
        await cat.put_variant(VariantMeta(task=TASK, family="mlp-tiny", variant_id=vid, format="onnx",
                                          precision="fp32", runtime="onnxruntime", blob_digest=digest,
                                          size_bytes=blobs.size(digest), accuracy=0.96, batch_sizes=[1, 8],
                                          inputs=_specs(sig.inputs), outputs=_specs(sig.outputs), owner=owner))
    pki = LocalPki.under(tmp_path / "operator")
    pki.init()
    for who in (OBSERVER, VICTIM):
        pki.issue(who, addresses=["127.0.0.1"])
    pki.issue(ATTACKER)  # names no address: a pod's certificate (a DNS name would do the same here)
    pki.issue(Identity("admin", "console"))
    # the attacker's certificate is where its agent would publish it: its key is admitted, its claims weighed
    await store.put(site_cert_key(ATTACKER.name), site_cert_record(pki.paths.cert(ATTACKER).read_bytes()))
    yield Mesh(store, etcd_server, tmp_path, pki, digest)


def _forwarded(target: Identity, hops: list[str], *, variant: str | None = VID, tenant: str = "public",
               routed: bool = False) -> InferRequest:
    return InferRequest(task=TASK, inputs={"x": np.full((1, 64), 0.25, np.float32)}, slo=SLO(10_000.0),
                        tenant=tenant, deadline=time.monotonic() + 10.0, hops=hops,
                        target_site=None if routed else target.name, target_variant=None if routed else variant)


async def _sees(agent: Agent, site: str) -> bool:
    return agent.view is not None and site in agent.view.live


async def test_a_site_claiming_anothers_endpoint_does_not_cut_it_off(mesh: Mesh) -> None:
    mesh.seed(VICTIM)
    async with Agent(mesh.config(VICTIM)) as victim:
        assert victim.curve is not None
        # the attacker advertises the victim's endpoint and URL as its own
        await mesh.attacker_record(endpoint=victim.zmq_endpoint, http=victim.http_url)
        async with Agent(mesh.config(OBSERVER)) as observer:
            assert observer.peer_keys is not None and observer.zmq_client is not None
            await eventually(lambda: _sees(observer, VICTIM.name), 10.0, "the observer sees the victim")
            assert await _sees(observer, ATTACKER.name)
            # the victim's endpoint is dialled with the victim's key (before: with the attacker's, or none)
            assert observer.peer_keys.server_key(victim.zmq_endpoint) == victim.curve.keys.public
            # and a query the observer forwards there is served (once the victim holds the observer's certificate)
            await eventually(lambda: _admits(victim, OBSERVER.name), 10.0, "the victim admits the observer")
            resp = await eventually(lambda: _try(observer, victim.zmq_endpoint, _forwarded(VICTIM, [OBSERVER.name])),
                                    10.0, "the observer's forward is served")
            assert resp.site == VICTIM.name and resp.outputs["logits"].shape == (1, 10)
            # the attacker is dialled nowhere: not at the victim's endpoint under its own identity
            assert observer._peer_endpoint(VICTIM.name) == victim.zmq_endpoint
            assert observer._peer_endpoint(ATTACKER.name) is None


async def _admits(agent: Agent, site: str) -> bool:
    return agent.curve is not None and agent.curve.sites.admits(site)


async def _try(agent: Agent, endpoint: str, req: InferRequest) -> InferResponse | None:
    """``agent``'s request answered, or None while its first handshake's refusal is being probed away."""
    assert agent.zmq_client is not None
    try:
        return await agent.zmq_client.request(endpoint, req)
    except PeerUnavailable:
        return None


class Trap:
    """An HTTP server that records every request it gets: where a hostile live record points."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> Trap:
        async def anything(request: web.Request) -> web.Response:
            self.requests.append(request.path)
            return web.Response(text="# nothing\n")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", anything)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_peers_never_fetch_a_blob_at_a_url_the_certificate_does_not_vouch_for(mesh: Mesh) -> None:
    async with Trap() as trap, Agent(mesh.config(OBSERVER)) as observer:
        assert observer.host is not None and observer.view is not None
        # the attacker says it holds the variant, and serves its edge API (and blobs) at an internal URL
        await mesh.attacker_record(endpoint="tcp://127.0.0.1:9", http=trap.url,
                                   loaded={VID: LoadedVariant(task=TASK)})
        await eventually(lambda: _sees(observer, ATTACKER.name), 10.0, "the observer sees the attacker")
        meta = observer.view.variant(TASK, VID)
        assert meta is not None
        with pytest.raises(RuntimeLoadError, match="no peer holds blob"):  # none it believes, and no store runs
            await observer.host.ensure(meta)
        assert trap.requests == [], f"fetched at the attacker's say-so: {trap.requests}"


async def test_the_console_never_scrapes_a_url_the_certificate_does_not_vouch_for(mesh: Mesh) -> None:
    async with Trap() as trap, Agent(mesh.config(OBSERVER)):
        await mesh.attacker_record(endpoint="tcp://127.0.0.1:9", http=trap.url)
        # the console scrapes the agents with its admin certificate, as the scheduler's console does
        admin = ReloadingCredentials.for_identity(mesh.pki.paths, Identity("admin", "console"))
        scraper = Scraper(admin.client_context())
        state = ConsoleState(mesh.store, scraper, tick_s=60.0)
        async with scraper, state:
            await eventually(lambda: _sees_console(state), 10.0, "the console sees both sites")
            await state.refresh()
            await scraper.recent_traces(state.live_urls())
            assert trap.requests == [], f"fetched at the attacker's say-so: {trap.requests}"
            assert ATTACKER.name not in state.live_urls()
            assert state._scrapes[OBSERVER.name].metrics is not None  # the honest agent is scraped as before


async def _sees_console(state: ConsoleState) -> bool:
    return {ATTACKER.name, OBSERVER.name} <= set(state.view.live)


@contextlib.asynccontextmanager
async def _victim(mesh: Mesh) -> AsyncIterator[tuple[Agent, ZmqClient]]:
    """The victim's agent, holding the model's blob, and the attacker's CURVE client dialling it."""
    mesh.seed(VICTIM)
    async with Agent(mesh.config(VICTIM)) as victim:
        client = mesh.attacker_client(victim)
        try:
            # what the attacker forwards as itself, to a variant here: served (it is a site like any other)
            resp = await client.request(victim.zmq_endpoint, _forwarded(VICTIM, [ATTACKER.name]))
            assert resp.site == VICTIM.name
            yield victim, client
        finally:
            await client.close()


async def test_a_site_cannot_forward_as_another_door(mesh: Mesh) -> None:
    async with _victim(mesh) as (victim, client):
        # a query it claims another door admitted (and charged): before, only the last hop was checked
        with pytest.raises(PermissionDenied, match="claims hops"):
            await client.request(victim.zmq_endpoint, _forwarded(VICTIM, [OBSERVER.name, ATTACKER.name]))
        # another tenant's private variant, claiming to be a tenant that may not use it (refused as before)
        with pytest.raises(UnknownTask):
            await client.request(victim.zmq_endpoint, _forwarded(VICTIM, [ATTACKER.name], tenant="globex",
                                                                 variant="mlp-tiny.acme-private"))


async def test_a_forwarded_query_is_served_never_routed_again(mesh: Mesh) -> None:
    async with _victim(mesh) as (victim, client):
        # no target here: the victim would route it (and forward it) as if it were its door, charging nothing
        with pytest.raises(PermissionDenied, match="never forwarded again"):
            await client.request(victim.zmq_endpoint, _forwarded(VICTIM, [ATTACKER.name], routed=True))
        with pytest.raises(PermissionDenied, match="never forwarded again"):
            await client.request(victim.zmq_endpoint, _forwarded(OBSERVER, [ATTACKER.name]))


async def test_a_door_spends_at_most_its_share_of_a_tenant_where_it_forwards(mesh: Mesh) -> None:
    async with _victim(mesh) as (victim, client):
        # acme's whole quota is ACME_QPS: the attacker, not live in the victim's view, may spend no more than that
        # (with the headroom for views a heartbeat apart) however many queries it claims for acme
        t0, ok, refused = time.monotonic(), 0, 0
        for _ in range(6 * ACME_QPS):
            try:
                await client.request(victim.zmq_endpoint, _forwarded(VICTIM, [ATTACKER.name], tenant="acme"))
                ok += 1
            except Overloaded:
                refused += 1
        elapsed = time.monotonic() - t0
        # at most 1.5 x the tenant's rate (PEER_HEADROOM), after a burst of two seconds of it (PEER_BURST_S)
        assert ok <= 1.5 * ACME_QPS * (2.0 + elapsed) + 1, (ok, refused, elapsed)
        limit = victim.peer_quota.limits(ATTACKER.name)["acme"]
        assert limit.qps is not None and limit.qps <= 1.5 * ACME_QPS
        assert ok <= limit.burst + limit.qps * elapsed + 1, (ok, refused, elapsed)
        assert refused >= 6 * ACME_QPS - limit.burst - limit.qps * elapsed - 1


async def test_the_cold_loads_a_site_causes_elsewhere_are_bounded(mesh: Mesh) -> None:
    async with _victim(mesh) as (victim, client):
        assert victim.host is not None
        served, refused = [], []
        for vid in COLD:  # each a variant the victim does not hold: a cold load (and evictions, once full)
            try:
                resp = await client.request(victim.zmq_endpoint, _forwarded(VICTIM, [ATTACKER.name], variant=vid))
                served.append(resp.variant)
            except Overloaded as exc:
                assert "cold loads" in str(exc)
                refused.append(vid)
        # the first query's load (VID) and three more: PEER_LOAD_BURST; what it has loaded is served on
        assert served == COLD[:3] and refused == COLD[3:]
        assert set(served) <= set(victim.host.loaded)
        resp = await client.request(victim.zmq_endpoint, _forwarded(VICTIM, [ATTACKER.name], variant=served[0]))
        assert resp.site == VICTIM.name
