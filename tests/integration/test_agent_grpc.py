"""A real agent (in this process, on the session etcd) serves the Open Inference Protocol over gRPC beside its
HTTPS front, with the same mutual TLS: a tenant reads a task's metadata and config with unmodified
``tritonclient.grpc.aio``, a site identity is refused the tenant API, and ``grpc_port=None`` serves no gRPC."""

from __future__ import annotations

from pathlib import Path

import pytest
import tritonclient.grpc.aio as tgrpc_aio
from tritonclient.utils import InferenceServerException

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.build import signature_from_onnx
from variant_store.catalog import Catalog

pytestmark = pytest.mark.integration

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
TASK = "digit-classification"
DIGITS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"
SITE, ACME = Identity("site", "edge-fra-1"), Identity("tenant", "acme")


def _client(pki: LocalPki, address: str, who: Identity) -> tgrpc_aio.InferenceServerClient:
    p = pki.paths
    return tgrpc_aio.InferenceServerClient(address, ssl=True, root_certificates=str(p.ca_cert),
                                           private_key=str(p.key(who)), certificate_chain=str(p.cert(who)))


async def test_agent_serves_grpc_with_client_certificates(store: Store, etcd_server: EmbeddedEtcd,
                                                          tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    await Catalog(store).put_task(signature_from_onnx(TASK, DIGITS / "mlp-tiny.onnx"))
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(SITE, addresses=["127.0.0.1"])
    pki.issue(ACME)
    cfg = AgentConfig(site=SITE.name, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path, lease_ttl_s=2.0,
                      tls=True)
    async with Agent(cfg) as agent:
        url = agent.grpc_url
        assert url is not None and url.startswith("grpcs://127.0.0.1:")
        address = url.removeprefix("grpcs://")
        c = _client(pki, address, ACME)
        try:
            assert await c.is_server_live()
            meta = await c.get_model_metadata(TASK)
            assert meta.name == TASK and meta.inputs[0].datatype == "FP32"
            config = await c.get_model_config(TASK)
            assert config.config.name == TASK
        finally:
            await c.close()
        site = _client(pki, address, SITE)
        try:
            assert await site.is_server_live()  # health admits any identity, as REST's
            with pytest.raises(InferenceServerException) as info:
                await site.get_model_metadata(TASK)
            assert info.value.status() == "StatusCode.PERMISSION_DENIED"
        finally:
            await site.close()


async def test_no_grpc_front_when_its_port_is_none(store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    cfg = AgentConfig(site=SITE.name, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path, lease_ttl_s=2.0,
                      insecure=True, grpc_port=None)
    async with Agent(cfg) as agent:
        assert agent.grpc is None and agent.grpc_url is None
