"""One agent in this process, on the session etcd: its device-memory budget comes from the topology's GPUs
(core-eu declares a 40 GiB A100), scaled to the device present (a 16 GiB one stands in for it here), and reaches
its heartbeat and ``/metrics``; a site that declares no GPU and has no device budgets nothing."""

from __future__ import annotations

import glob
from pathlib import Path

import aiohttp
import pytest

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology

pytestmark = pytest.mark.integration

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
MIB = 1 << 20


@pytest.mark.parametrize(("site", "device_mb", "budget"), [
    ("core-eu", 16384, int(16384 * MIB * 0.9)),   # scaled down to the smaller device present
    ("core-eu", 81920, int(40960 * MIB * 0.9)),   # the declared GPU's memory is the budget
    ("edge-fra-1", None, 0),                      # no device here (CPU-only test machine): no budget
])
async def test_the_device_budget_reaches_heartbeat_and_metrics(store: Store, etcd_server: EmbeddedEtcd,
                                                               tmp_path: Path, site: str, device_mb: int | None,
                                                               budget: int) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    cfg = AgentConfig(site=site, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path, lease_ttl_s=2.0,
                      insecure=True, device_memory_mb=device_mb)
    if device_mb is None and glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("a CUDA device node is present: the detected device would be budgeted")
    async with Agent(cfg) as agent, aiohttp.ClientSession() as http:
        assert agent.host is not None and agent.host.device_budget_bytes == budget
        hb = agent._live_record()
        assert hb.device_memory_budget_bytes == budget and hb.device_memory_used_bytes == 0
        assert agent.http is not None
        async with http.get(f"{agent.http.url}/metrics") as resp:
            assert resp.status == 200, await resp.text()
            lines = (await resp.text()).splitlines()
        assert f"tiermesh_device_memory_budget_bytes {float(budget)!r}" in lines
        assert "tiermesh_device_memory_used_bytes 0.0" in lines
