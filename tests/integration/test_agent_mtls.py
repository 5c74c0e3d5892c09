"""A real agent (in this process, on the session etcd) serves its edge API over mutual TLS with its site
certificate from ``home/pki``: a tenant is served, a caller without a certificate is refused, a site identity
is forbidden the tenant API, and a re-issued site certificate is presented without a restart."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.errors import PkiError
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.verify import peer_certificate
from tests.helpers.mtls_edge import HANDSHAKE, call, client_context, tenant_context
from tests.helpers.waiting import eventually
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.build import signature_from_onnx
from variant_store.catalog import Catalog

pytestmark = pytest.mark.integration

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
TASK = "digit-classification"
DIGITS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"
SITE, ACME = Identity("site", "edge-fra-1"), Identity("tenant", "acme")


async def _server_serial(url: str, ctx: ssl.SSLContext) -> int:
    """The serial of the certificate the server presents on a new connection."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port, ssl=ctx), 15)
    try:
        return peer_certificate(writer.get_extra_info("ssl_object")).serial_number
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), 15)


async def test_agent_serves_https_with_client_certificates(store: Store, etcd_server: EmbeddedEtcd,
                                                           tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    await Catalog(store).put_task(signature_from_onnx(TASK, DIGITS / "mlp-tiny.onnx"))
    cfg = AgentConfig(site=SITE.name, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path, lease_ttl_s=2.0,
                      tls=True)
    with pytest.raises(PkiError, match="pki issue --site edge-fra-1"):
        async with Agent(cfg):
            pass  # no CA, no site certificate: the agent refuses to start rather than serve in the clear
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(SITE, addresses=["127.0.0.1"])
    pki.issue(ACME)
    async with Agent(cfg) as agent:
        assert agent.http is not None
        url = agent.http_url
        assert url.startswith("https://127.0.0.1:")
        status, body = await call(url, tenant_context(pki, ACME), infer=False)
        assert status == 200 and body["name"] == TASK
        assert (await call(url, client_context(pki.paths.ca_cert), infer=False))[0] == HANDSHAKE
        status, body = await call(url, tenant_context(pki, SITE), infer=False)
        assert status == 403 and body["code"] == "forbidden"
        ctx = tenant_context(pki, ACME)
        before = await _server_serial(url, ctx)
        new = pki.issue(SITE, addresses=["127.0.0.1"]).serial

        async def rotated() -> bool:
            return await _server_serial(url, ctx) == new

        await eventually(rotated, 10, "the agent presents its re-issued certificate")
        assert new != before
