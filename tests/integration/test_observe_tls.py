"""With edge TLS on, /metrics and other tenants' traces are for the admin (or scheduler) identity: a real
agent in this process, its edge API over mutual TLS, callers with certificates of each kind."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.helpers.mtls_edge import HANDSHAKE, client_context, tenant_context
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.build import signature_from_onnx
from variant_store.catalog import Catalog

pytestmark = pytest.mark.integration

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
TASK = "digit-classification"
DIGITS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"
SITE, ACME, ADMIN = Identity("site", "edge-fra-1"), Identity("tenant", "acme"), Identity("admin", "ops")
SCHED = Identity("scheduler", "s1")


async def _get(url: str, ctx: ssl.SSLContext) -> tuple[int | str, bytes]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=15)) as session:
        try:
            async with session.get(url) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientConnectionError, ssl.SSLError):
            return HANDSHAKE, b""


async def test_metrics_and_traces_need_the_admin_identity(store: Store, etcd_server: EmbeddedEtcd,
                                                          tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    await Catalog(store).put_task(signature_from_onnx(TASK, DIGITS / "mlp-tiny.onnx"))
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(SITE, addresses=["127.0.0.1"])
    for who in (ACME, ADMIN, SCHED):
        pki.issue(who)
    cfg = AgentConfig(site=SITE.name, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path, lease_ttl_s=2.0,
                      tls=True)
    async with Agent(cfg) as agent:
        # a trace of another tenant's request, kept at this door
        agent.traces.add("r-globex", "0" * 31 + "1", "globex", TASK, "ok", [])
        agent.traces.add("r-acme", "0" * 31 + "2", "acme", TASK, "ok", [])
        url = agent.http_url
        status, body = await _get(f"{url}/metrics", tenant_context(pki, ACME))
        assert status == 403 and json.loads(body)["code"] == "forbidden"
        assert (await _get(f"{url}/metrics", tenant_context(pki, SITE)))[0] == 403
        assert (await _get(f"{url}/metrics", client_context(pki.paths.ca_cert)))[0] == HANDSHAKE
        for reader in (ADMIN, SCHED):
            status, body = await _get(f"{url}/metrics", tenant_context(pki, reader))
            assert status == 200, body
            names = {f.name for f in text_string_to_metric_families(body.decode())}
            assert {"tiermesh_requests", "tiermesh_etcd_connected", "nv_inference_request_success"} <= names
        # traces: the admin reads any; a tenant only its own (another's is as unknown as a missing one)
        admin, acme = tenant_context(pki, ADMIN), tenant_context(pki, ACME)
        assert (await _get(f"{url}/v2/traces/r-globex", admin))[0] == 200
        assert (await _get(f"{url}/v2/traces/r-globex", acme))[0] == 404
        status, body = await _get(f"{url}/v2/traces/r-acme", acme)
        assert status == 200 and json.loads(body)["tenant"] == "acme"
        status, body = await _get(f"{url}/v2/traces?limit=10", acme)
        assert status == 200 and [t["request_id"] for t in json.loads(body)["traces"]] == ["r-acme"]
        status, body = await _get(f"{url}/v2/traces?limit=10", admin)
        assert [t["request_id"] for t in json.loads(body)["traces"]] == ["r-acme", "r-globex"]
        assert (await _get(f"{url}/v2/traces?limit=0", admin))[0] == 400
        assert (await _get(f"{url}/v2/traces/r-acme", tenant_context(pki, SITE)))[0] == 403
