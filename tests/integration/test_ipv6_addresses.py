"""Servers on IPv6 loopback: an agent bound to ``::1`` advertises ``tcp://[::1]:port`` and
``http://[::1]:port`` in its live record and answers on both; a ZeroMQ round trip over ``[::1]``;
the variant store announces its bracketed URL. Skipped where this machine has no ``::1``."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.errors import UnknownTask
from mesh.etcd.keys import blobs_key, live_key
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq.client import ZmqClient
from mesh.zmq.server import ZmqServer
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.server import VariantStoreServer

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


pytestmark = [pytest.mark.integration, pytest.mark.timeout(60),
              pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")]


def _req(task: str) -> InferRequest:
    return InferRequest(task=task, inputs={"x": np.arange(4, dtype=np.float32)}, slo=SLO(1000.0),
                        tenant="acme", deadline=time.monotonic() + 5.0, hops=["edge-a"])


async def test_zmq_round_trip_over_ipv6() -> None:
    async def echo(req: InferRequest) -> InferResponse:
        return InferResponse(request_id=req.request_id, outputs=dict(req.inputs), site="v6", variant="echo",
                             accuracy=1.0, reason="local_ok", tenant=req.tenant, hops=[*req.hops, "v6"])

    async with ZmqServer(echo, bind="tcp://[::1]:0") as server:
        assert server.endpoint.startswith("tcp://[::1]:")
        client = ZmqClient()
        try:
            resp = await client.request(server.endpoint, _req("echo"))
        finally:
            await client.close()
    assert resp.site == "v6"
    np.testing.assert_array_equal(resp.outputs["x"], np.arange(4, dtype=np.float32))


async def test_agent_on_ipv6_loopback_advertises_bracketed_addresses(store: Store, etcd_server: EmbeddedEtcd,
                                                                     tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    cfg = AgentConfig(site="edge-fra-1", etcd=etcd_server.url, prefix=store.prefix, home=tmp_path,
                      lease_ttl_s=2.0, bind="::1", insecure=True)
    async with Agent(cfg) as agent, aiohttp.ClientSession() as http:
        assert agent.http_url.startswith("http://[::1]:")
        assert agent.zmq_endpoint.startswith("tcp://[::1]:")
        live = None
        for _ in range(50):
            live = await store.get(live_key("edge-fra-1"))
            if live is not None:
                break
            await asyncio.sleep(0.05)
        assert live is not None
        assert live.value["endpoint"] == agent.zmq_endpoint and live.value["http"] == agent.http_url
        async with http.get(f"{agent.http_url}/v2/health/live") as resp:
            assert resp.status == 200
        # the ZeroMQ door answers over IPv6 too: a task nobody serves is refused, not dropped
        client = ZmqClient()
        try:
            with pytest.raises(UnknownTask):
                await client.request(agent.zmq_endpoint, _req("no-such-task"))
        finally:
            await client.close()


async def test_variant_store_announces_its_ipv6_url(store: Store, tmp_path: Path) -> None:
    server = VariantStoreServer(BlobStore(tmp_path / "blobs"), Catalog(store), host="::1")
    async with server, aiohttp.ClientSession() as http:
        assert server.url.startswith("http://[::1]:")
        record = await store.get(blobs_key())
        assert record is not None and record.value["url"] == server.url
        async with http.get(f"{server.url}/healthz") as resp:
            assert resp.status == 200
