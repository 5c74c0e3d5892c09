"""A tenant registers its own model over its own certificate (issue 34 item 1): a real agent door with mutual TLS, a
real variant store serving HTTPS with a data area (it runs the build), real etcd. acme registers a logistic
regression it trains here (not a committed family), follows the build to the end, sees its variants' accuracy, size
and latency, and the catalog holds them as acme's own. globex sees none of it and may not add to acme's task; a
hostile model is refused with its reason while the store keeps serving; a family in use is refused; a build the
store cannot finish fails with its reason and frees its family."""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from core_scheduler.state.builds import BuildBook
from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.buildspec import BuildRequest
from mesh.errors import ConflictError, MeshError, ModelRejected, PermissionDenied, RequestError
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.models import AsyncModels
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.helpers.mtls_edge import tenant_context
from tests.helpers_models import digits_split
from tests.integration.test_quota_flood import TASK, _catalog
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.access import StoreTls
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.data_area import DataArea
from variant_store.server import VariantStoreServer
from variant_store.tenant_builds import BuildOptions

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
SITE, STORE = Identity("site", "edge-fra-1"), Identity("store", "vs")
ACME, GLOBEX, PUBLIC = Identity("tenant", "acme"), Identity("tenant", "globex"), Identity("tenant", "public")
OPTIONS = BuildOptions(kinds=("onnx.fp32", "onnx.int8-dynamic"), repeats=3, batch_sizes=(1, 8), poll_s=0.2)


def logreg_onnx() -> bytes:
    """A logistic regression trained on the digits training split, as ONNX (x (N, 64) -> logits (N, 10))."""
    from sklearn.linear_model import LogisticRegression

    split = digits_split()
    clf = LogisticRegression(max_iter=500).fit(split.x_train, split.y_train)
    w = numpy_helper.from_array(clf.coef_.astype(np.float32), "w")
    b = numpy_helper.from_array(clf.intercept_.astype(np.float32), "b")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "b"], ["logits"], transB=1)], "logreg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def custom_op_onnx() -> bytes:
    node = helper.make_node("Exfiltrate", ["x"], ["logits"], domain="com.evil")
    graph = helper.make_graph([node], "evil", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.evil", 1)],
                             ir_version=8).SerializeToString()


async def _healthy(url: str, ctx: ssl.SSLContext) -> bool:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz", ssl=ctx) as r:
        return r.status == 200


async def test_a_tenant_registers_its_own_model_and_only_it_sees_it(store: Store, etcd_server: EmbeddedEtcd,
                                                                    tmp_path: Path) -> None:
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(SITE, addresses=["127.0.0.1"])
    pki.issue(STORE, addresses=["127.0.0.1"])
    for t in (ACME, GLOBEX, PUBLIC):
        pki.issue(t)
    await apply_topology(store, load_topology_file(TOPOLOGY))
    blobs = BlobStore(tmp_path / "blobs")
    await _catalog(store, blobs)  # the public task, with family mlp-tiny
    split = digits_split()
    x, y = split.x_val, split.y_val
    cfg = AgentConfig(site=SITE.name, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path, lease_ttl_s=2.0,
                      heartbeat_s=0.5, tls=True)
    catalog = Catalog(store)
    paths = pki.paths
    async with VariantStoreServer(blobs, catalog, host="127.0.0.1", tls=StoreTls(paths, STORE),
                                  data=DataArea(tmp_path / "data"), build_options=OPTIONS) as server, \
            Agent(cfg) as agent:
        for _ in range(200):  # bounded: the store's announcement reaches the agent's view
            if agent.host is not None and agent.host.blobs.store_url:
                break
            await asyncio.sleep(0.05)
        ca = paths.ca_cert
        async with AsyncModels(agent.http_url, cert=paths.cert(ACME), key=paths.key(ACME), ca=ca) as acme, \
                AsyncModels(agent.http_url, cert=paths.cert(GLOBEX), key=paths.key(GLOBEX), ca=ca) as globex:
            build = await acme.register("acme-digits", "acme-logreg", model=logreg_onnx(), validation=(x, y))
            assert build.admitted["state"] == "queued" and build.admitted["rows"] == len(x)
            seen: list[str] = []
            done = await build.wait(poll_s=5.0, timeout=240, progress=lambda st: seen.append(st["state"]))
            assert (done["state"], done["stage"], done["progress"]) == ("done", "done", 1.0) and seen[-1] == "done"
            got = {v["variant"]: v for v in done["variants"]}
            assert set(got) == {"acme-logreg.onnx.fp32", "acme-logreg.onnx.int8-dynamic"}
            fp32 = got["acme-logreg.onnx.fp32"]
            assert fp32["accuracy"] > 0.9 and fp32["size_bytes"] > 0 and fp32["catalogued"] is True
            assert all(set(per) == {"1", "8"} for per in fp32["latency_ms"].values()) and fp32["latency_ms"]
            # the catalog holds them as acme's own: private, not the public catalog's
            metas = await catalog.list_variants("acme-digits")
            assert {m.variant_id for m in metas} == set(got) and {m.owner for m in metas} == {"acme"}
            assert [(m.family, m.owner) for m in await catalog.list_models("acme-digits")] == [("acme-logreg", "acme")]
            assert [b["id"] for b in await acme.list("acme-digits")] == [build.id]

            # globex sees none of it, and may not add to acme's task
            with pytest.raises(RequestError) as hidden:
                await globex.show("acme-digits", build.id)
            assert "no build" in str(hidden.value)
            assert await globex.list() == []
            with pytest.raises(PermissionDenied):
                await globex.register("acme-digits", "globex-logreg", model=logreg_onnx(), validation=(x, y))
            public = AsyncModels(agent.http_url, cert=paths.cert(PUBLIC), key=paths.key(PUBLIC), ca=ca)
            async with public:  # the public catalog is the operators': no tenant "public" adds to it here
                with pytest.raises(PermissionDenied):
                    await public.register("public-new", "public-logreg", model=logreg_onnx(), validation=(x, y))
            with pytest.raises(PermissionDenied):  # nor may anyone add to the public catalog's task
                await acme.register(TASK, "acme-mlp", model=logreg_onnx(), validation=(x, y))
            # a family in use: another task's (acme's own, or the public mlp-tiny), or registered already
            for task, family in (("acme-other", "acme-logreg"), ("acme-other", "mlp-tiny"),
                                 ("acme-digits", "acme-logreg")):
                with pytest.raises(ConflictError):
                    await acme.register(task, family, model=logreg_onnx(), validation=(x, y))

            # hostile inputs: refused at the door with their reason; nothing is queued, the store serves on
            with pytest.raises(ModelRejected) as evil:
                await acme.register("acme-evil", "evil", model=custom_op_onnx(), validation=(x, y))
            assert evil.value.details["reason"] == "custom_domain" and "custom_domain" in str(evil.value)
            with pytest.raises(ModelRejected) as cut:
                await acme.register("acme-evil", "evil", model=logreg_onnx()[:200], validation=(x, y))
            assert cut.value.details["reason"] == "bad_protobuf"
            with pytest.raises(RequestError) as bad_npz:
                await acme.register("acme-evil", "evil", model=logreg_onnx(), validation=b"not an npz")
            assert "validation set" in str(bad_npz.value)
            assert [b["id"] for b in await acme.list()] == [build.id]
            assert await _healthy(server.url, tenant_context(pki, ACME))

            # a build the store cannot finish (rows of 32 features for a 64-feature model) fails with its reason
            # and takes its registration out again: the family is free for the next try
            wrong = await acme.register("acme-wrong", "acme-wrong", model=logreg_onnx(),
                                        validation=(x[:, :32].copy(), y))
            with pytest.raises(MeshError) as failed:
                await wrong.wait(poll_s=5.0, timeout=240)
            assert failed.value.details["reason"] in ("sandbox", "no_variant"), failed.value
            assert await catalog.list_models("acme-wrong") == []
            assert "acme-wrong" not in await catalog.list_tasks()

            # a request naming inputs that are not in acme's data area (as a forged one would): failed, not run
            forged = BuildRequest(build_id=uuid.uuid4().hex, tenant="acme", task="acme-forged", family="forged",
                                  model_digest="0" * 64, model_bytes=1, validation_digest="1" * 64,
                                  validation_bytes=1, rows=2, door=SITE.name, created=time.time())
            await BuildBook(store).create(forged)
            with pytest.raises(MeshError) as missing:
                await acme.build("acme-forged", forged.build_id).wait(poll_s=5.0, timeout=60)
            assert missing.value.details["reason"] == "missing_input"
            assert await _healthy(server.url, tenant_context(pki, ACME))

        # the CLI, as acme: a second family in its own existing task, followed to the end; then its builds
        (tmp_path / "m.onnx").write_bytes(logreg_onnx())
        np.savez(tmp_path / "v.npz", x=x, y=y)
        creds = ["--edge", agent.http_url, "--cert", str(paths.cert(ACME)), "--key", str(paths.key(ACME)),
                 "--ca", str(paths.ca_cert)]
        rc, out = await _cli("register", *creds, "acme-digits", "acme-logreg2", str(tmp_path / "m.onnx"),
                             str(tmp_path / "v.npz"), "--wait")
        assert rc == 0, out
        assert '"state": "done"' in out and "acme-logreg2.onnx.fp32" in out
        rc, out = await _cli("builds", *creds, "acme-digits")
        assert rc == 0 and json.loads(out)[0]["family"] == "acme-logreg2" and len(json.loads(out)) == 2
        rc, out = await _cli("show", *creds, build.id)
        assert rc == 0 and json.loads(out)["state"] == "done"
        assert {m.owner for m in await catalog.list_variants("acme-digits")} == {"acme"}


async def _cli(*args: str) -> tuple[int, str]:
    """``tiermesh models ARGS`` in a child process (bounded): its exit code and stdout (stderr after it)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tiermesh", "models", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 180)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return int(proc.returncode or 0), out.decode() + ("\n" + err.decode() if proc.returncode else "")
