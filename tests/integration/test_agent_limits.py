"""One agent in this process, on the session etcd: the body limit an operator sets reaches both
doors (HTTP and ZeroMQ), and an oversized request is refused while the agent keeps serving."""

from __future__ import annotations

import argparse
from pathlib import Path

import aiohttp
import pytest

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.settings import MeshSettings
from tiermesh.cli.agent import agent_config
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.build import signature_from_onnx
from variant_store.catalog import Catalog

pytestmark = pytest.mark.integration

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
LIMIT = 4096
TASK = "digit-classification"
DIGITS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"


def test_settings_reach_the_agent_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERMESH_MAX_BODY_BYTES", str(LIMIT))
    args = argparse.Namespace(etcd="http://127.0.0.1:1", site="edge-fra-1", prefix=None, home=None, http_port=0,
                              zmq_port=0, peer_map=None, lease_ttl=2.0, routing_mode="tiermesh")
    cfg = agent_config(args, MeshSettings())
    assert cfg.max_body_bytes == LIMIT and cfg.etcd == "http://127.0.0.1:1"


async def test_an_oversized_body_is_refused_at_both_doors(store: Store, etcd_server: EmbeddedEtcd,
                                                          tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    # the task must be known (an unknown task is refused before its body is read); no variant is needed
    await Catalog(store).put_task(signature_from_onnx(TASK, DIGITS / "mlp-tiny.onnx"))
    cfg = AgentConfig(site="edge-fra-1", etcd=etcd_server.url, prefix=store.prefix, home=tmp_path,
                      lease_ttl_s=2.0, max_body_bytes=LIMIT, insecure=True)
    async with Agent(cfg) as agent, aiohttp.ClientSession() as http:
        assert agent.http is not None and agent.zmq_server is not None
        assert agent.zmq_server._max_bytes == LIMIT
        url = f"{agent.http.url}/v2/models/{TASK}/infer"
        big = {"inputs": [{"name": "x", "shape": [1, 2048], "datatype": "FP32", "data": [0.5] * 2048}]}
        async with http.post(url, json=big) as resp:
            assert resp.status == 413, await resp.text()
        async with http.get(f"{agent.http.url}/v2/health/live") as resp:
            assert resp.status == 200  # still serving
    assert agent.state.value == "stopped"
