"""Another tenant's private task answers exactly as a task that does not exist, on every way in: the HTTP front
(tests/integration/test_edge_hostile_tenant.py) and the data plane itself, which the ZeroMQ server and the
in-process SDK reach without the HTTP front. One agent in this process, on the session etcd."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.errors import UnknownTask
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.types import SLO, InferRequest
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.build import signature_from_onnx
from variant_store.catalog import Catalog
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.integration

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
DIGITS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"
PRIVATE = "acme-digits"


async def _ask(agent: Agent, task: str, tenant: str) -> str:
    assert agent.dataplane is not None
    req = InferRequest.entering(task, {"x": np.zeros((1, 64), np.float32)}, SLO(latency_ms=100.0, min_accuracy=0.0),
                                tenant=tenant)
    with pytest.raises(UnknownTask) as info:
        await agent.dataplane.infer(req)
    return str(info.value).replace(repr(task), "TASK")


async def test_a_private_task_is_unknown_to_other_tenants_at_the_data_plane(store: Store, etcd_server: EmbeddedEtcd,
                                                                            tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    catalog = Catalog(store)
    sig = signature_from_onnx(PRIVATE, DIGITS / "mlp-tiny.onnx")
    await catalog.put_task(sig)
    meta = VariantMeta(task=PRIVATE, family="f", variant_id="f.v1", format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest="ab" * 32, size_bytes=1, accuracy=0.9, owner="acme")
    await catalog.put_variant(meta)
    cfg = AgentConfig(site="edge-fra-1", etcd=etcd_server.url, prefix=store.prefix, home=tmp_path, lease_ttl_s=2.0,
                      insecure=True)
    async with Agent(cfg) as agent:
        assert agent.view is not None and PRIVATE in agent.view.signatures
        missing = await _ask(agent, "no-such-task", "globex")
        private = await _ask(agent, PRIVATE, "globex")
        assert private == missing and "acme" not in private and "digit" not in private
        assert agent.dataplane is not None and agent.dataplane.visible(PRIVATE, "acme")
        assert not agent.dataplane.visible(PRIVATE, "globex")
