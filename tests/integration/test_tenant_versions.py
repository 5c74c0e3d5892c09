"""Versions and retirement of a tenant's task (issue 34 item 3), with real etcd, a real variant store serving HTTPS
(it runs the builds and the version keeper) and a real agent door over mutual TLS. acme registers version 1 (a weak
logistic regression trained here on a few rows), queries it, registers version 2 (one trained on every row) and
sees traffic move to it with no failed query meanwhile; splits 50/50 and sees both versions answer; deletes the
task and sees it gone (404 / unknown task) and its blobs collected. globex can do none of it to acme's task.

With a declared accuracy bar (``min_accuracy``): a first version below it is held and the task has no active
version; one above it takes traffic; a later one below it (the bar kept from before) is held while traffic stays; each
build's status says which and why."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.client import AsyncClient
from mesh.errors import MeshError, NoRoute, RequestError, UnknownTask
from mesh.etcd.keys import placement_key, version_key
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.models import AsyncModels
from mesh.pki.local import LocalPki
from tests.helpers_models import digits_split
from tests.integration.test_quota_flood import _catalog
from tests.integration.test_tenant_models import ACME, GLOBEX, SITE, STORE, TOPOLOGY
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.access import StoreTls
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.data_area import DataArea
from variant_store.server import VariantStoreServer
from variant_store.tenant_builds import BuildOptions
from variant_store.version_keeper import VersionKeeper

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TASK = "acme-versions"
OPTIONS = BuildOptions(kinds=("onnx.fp32",), repeats=3, batch_sizes=(1, 8), poll_s=0.2, retire_grace_s=120.0)


def logreg(rows: int) -> bytes:
    """A logistic regression trained on the first ``rows`` rows of the digits training split, as ONNX."""
    from sklearn.linear_model import LogisticRegression

    split = digits_split()
    clf = LogisticRegression(max_iter=500).fit(split.x_train[:rows], split.y_train[:rows])
    w = numpy_helper.from_array(clf.coef_.astype(np.float32), "w")
    b = numpy_helper.from_array(clf.intercept_.astype(np.float32), "b")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "b"], ["logits"], transB=1)], "logreg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model.SerializeToString()


async def _variant(client: AsyncClient, x: np.ndarray, task: str = TASK) -> str:
    res = await client.infer(task, x, latency_ms=3000.0, timeout=15.0)
    return str(res.variant)


async def _first_answer(client: AsyncClient, x: np.ndarray, family: str, timeout_s: float = 120.0,
                        task: str = TASK) -> None:
    """Query (every 0.3 s, bounded) until ``family`` answers."""
    end, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < end:
        try:
            last = await _variant(client, x, task)
            if last.startswith(family + "."):
                return
        except MeshError as exc:
            last = repr(exc)
        await asyncio.sleep(0.3)
    pytest.fail(f"{family} did not answer within {timeout_s:.0f} s: last {last}")


async def _place(store: Store, catalog: Catalog, task: str = TASK) -> None:
    """The scheduler's part, done by hand (this test runs no scheduler): place every variant of the task at the one
    site, as placement would on demand, so the store lets the site fetch acme's private blobs. Bounded."""
    for _ in range(6000):
        placed = [{"task": task, "variant_id": m.variant_id} for m in await catalog.list_variants(task)]
        await store.put(placement_key(SITE.name), {"variants": placed})
        await asyncio.sleep(0.3)


@dataclass(frozen=True)
class _Mesh:
    agent: Agent
    catalog: Catalog
    blobs: BlobStore
    creds: dict[str, Any]    # acme's certificate
    other: dict[str, Any]    # globex's


@contextlib.asynccontextmanager
async def _mesh(store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path, task: str = TASK) -> AsyncIterator[_Mesh]:
    """A variant store running builds and an agent door over mutual TLS, ``task``'s variants placed at the site."""
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(SITE, addresses=["127.0.0.1"])
    pki.issue(STORE, addresses=["127.0.0.1"])
    for t in (ACME, GLOBEX):
        pki.issue(t)
    await apply_topology(store, load_topology_file(TOPOLOGY))
    blobs = BlobStore(tmp_path / "blobs")
    await _catalog(store, blobs)
    cfg = AgentConfig(site=SITE.name, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path, lease_ttl_s=2.0,
                      heartbeat_s=0.5, tls=True)
    catalog = Catalog(store)
    paths, ca = pki.paths, pki.paths.ca_cert
    async with VariantStoreServer(blobs, catalog, host="127.0.0.1", tls=StoreTls(paths, STORE),
                                  data=DataArea(tmp_path / "data"), build_options=OPTIONS), Agent(cfg) as agent:
        for _ in range(200):  # bounded: the store's announcement reaches the agent's view
            if agent.host is not None and agent.host.blobs.store_url:
                break
            await asyncio.sleep(0.05)
        placer = asyncio.ensure_future(_place(store, catalog, task))
        try:
            yield _Mesh(agent, catalog, blobs, {"cert": paths.cert(ACME), "key": paths.key(ACME), "ca": ca},
                        {"cert": paths.cert(GLOBEX), "key": paths.key(GLOBEX), "ca": ca})
        finally:
            placer.cancel()
            await asyncio.gather(placer, return_exceptions=True)


async def test_versions_move_split_and_delete(store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    split = digits_split()
    x, y = split.x_val, split.y_val
    async with _mesh(store, etcd_server, tmp_path) as mesh:
        agent, catalog, blobs, creds, other = mesh.agent, mesh.catalog, mesh.blobs, mesh.creds, mesh.other
        async with AsyncModels(agent.http_url, **creds) as acme, AsyncModels(agent.http_url, **other) as globex, \
                AsyncClient(agent.http_url, timeout=20.0, **creds) as client:
            v1 = await acme.register(TASK, "acme-few", model=logreg(60), validation=(x, y))
            done1 = await v1.wait(poll_s=5.0, timeout=240)
            assert done1["state"] == "done"
            got = await acme.versions(TASK)
            assert got["active"] == 1 and got["traffic"] == {"1": 1.0}, got
            await _first_answer(client, x[:4], "acme-few")

            # version 2 builds while version 1 serves: every query answered throughout, then traffic moves
            v2 = await acme.register(TASK, "acme-all", model=logreg(len(split.x_train)), validation=(x, y))
            answered: list[str] = []
            failures: list[str] = []

            async def keep_querying() -> None:
                for _ in range(2000):  # bounded
                    try:
                        answered.append(await _variant(client, x[:4]))
                    except MeshError as exc:
                        failures.append(repr(exc))
                    if answered and answered[-1].startswith("acme-all."):
                        return
                    await asyncio.sleep(0.1)

            querier = asyncio.ensure_future(keep_querying())
            try:
                done2 = await v2.wait(poll_s=5.0, timeout=240)
                await asyncio.wait_for(asyncio.shield(querier), 120)
            finally:
                querier.cancel()
                await asyncio.gather(querier, return_exceptions=True)
            assert done2["state"] == "done"
            assert not failures, failures[:3]
            assert answered and answered[-1].startswith("acme-all.")
            first_v2 = next(i for i, v in enumerate(answered) if v.startswith("acme-all."))
            assert all(v.startswith("acme-few.") for v in answered[:first_v2])  # v1 until the move, never a gap
            got = await acme.versions(TASK)
            states = {v["version"]: v["state"] for v in got["versions"]}
            assert got["active"] == 2 and states == {1: "retiring", 2: "active"}, got
            assert {m.version: m.share for m in await catalog.list_variants(TASK)} == {1: 0.0, 2: 1.0}
            # a caller may pin a version while it is catalogued: version 1 answers it, share 0 or not
            for pinned, family in ((1, "acme-few."), (2, "acme-all.")):
                for _ in range(5):
                    res = await client.infer(TASK, x[:4], latency_ms=3000.0, timeout=15.0, version=pinned)
                    assert str(res.variant).startswith(family), (pinned, res.variant)
            with pytest.raises(RequestError, match="version"):
                await client.infer(TASK, x[:4], latency_ms=3000.0, timeout=15.0, version=0)

            # a 50/50 split: both versions answer (retirement waits while the split names version 1)
            got = await acme.traffic(TASK, {1: 1, 2: 1})
            assert got["traffic"] == {"1": 0.5, "2": 0.5}
            seen: set[str] = set()
            for _ in range(200):  # bounded
                seen.add((await _variant(client, x[:4])).split(".")[0])
                if seen == {"acme-few", "acme-all"}:
                    break
                await asyncio.sleep(0.05)
            assert seen == {"acme-few", "acme-all"}
            with pytest.raises(RequestError, match="no servable version 7"):
                await acme.traffic(TASK, {7: 1.0})

            # globex can neither read, split nor delete acme's task: 404, as for a task that does not exist
            for attempt in (globex.versions(TASK), globex.traffic(TASK, {2: 1.0}), globex.delete(TASK)):
                with pytest.raises(UnknownTask):
                    await attempt
            assert len(await catalog.list_variants(TASK)) == 2

            # the split ends on version 2 alone: version 1 retires once its grace is over, blobs collected
            got = await acme.traffic(TASK, {2: 1.0})
            assert got["traffic"] == {"2": 1.0} and got["active"] == 2
            old_blobs = {m.blob_digest for m in await catalog.list_variants(TASK) if m.version == 1}
            keeper = VersionKeeper(catalog, blobs)
            # what the grace is for: the door's view learns version 1's share is 0 before its variants go (the
            # test skips the 60 s below, so it waits for the view itself)
            deadline = time.monotonic() + 15.0
            streak = 0
            while streak < 10 and time.monotonic() < deadline:
                streak = streak + 1 if (await _variant(client, x[:4])).startswith("acme-all.") else 0
            assert streak >= 10, "the door kept routing to version 1 after its share went to 0"
            assert await keeper.retire_due(now=time.time()) == []  # the grace is not over
            assert await keeper.retire_due(now=time.time() + 1000) == [(TASK, 2 - 1)]
            assert {m.version for m in await catalog.list_variants(TASK)} == {2}
            assert [m.family for m in await catalog.list_models(TASK)] == ["acme-all"]
            assert old_blobs and not any(blobs.has(d) for d in old_blobs)
            assert {v["version"]: v["state"] for v in (await acme.versions(TASK))["versions"]} == {
                1: "retired", 2: "active"}
            for _ in range(20):
                assert (await _variant(client, x[:4])).startswith("acme-all.")

            # delete: gone from the catalog (so placement unloads it), its record gone, its blobs collected
            digests = {m.blob_digest for m in await catalog.list_variants(TASK)}
            digests |= {d for m in await catalog.list_models(TASK) for d in (m.parent_digest, m.validation_digest)}
            assert all(blobs.has(d) for d in digests)
            gone = await acme.delete(TASK)
            assert set(gone["collected_blobs"]) == digests, gone
            assert not any(blobs.has(d) for d in digests)
            assert await catalog.list_variants(TASK) == [] and await catalog.list_models(TASK) == []
            assert await store.get(version_key(TASK)) is None
            with pytest.raises(UnknownTask):
                await acme.versions(TASK)
            with pytest.raises(UnknownTask):
                await acme.delete(TASK)
            for _ in range(100):  # bounded: the door's view follows the catalog by watch
                try:
                    await _variant(client, x[:4])
                except UnknownTask:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the deleted task still answers")


BAR_TASK = "acme-bar"


async def test_a_declared_bar_holds_versions_below_it(store: Store, etcd_server: EmbeddedEtcd,
                                                      tmp_path: Path) -> None:
    split = digits_split()
    x, y = split.x_val, split.y_val
    async with _mesh(store, etcd_server, tmp_path, BAR_TASK) as mesh, \
            AsyncModels(mesh.agent.http_url, **mesh.creds) as acme, \
            AsyncClient(mesh.agent.http_url, timeout=20.0, **mesh.creds) as client:
        catalog = mesh.catalog
        for bad in (1.5, -0.1, float("nan")):  # the door's check, before a byte of the upload is kept
            with pytest.raises(RequestError, match="min_accuracy must be a number in \\[0, 1\\]"):
                await acme.register(BAR_TASK, "acme-bad", model=logreg(60), validation=(x, y), min_accuracy=bad)

        # a first version below the declared bar (60 rows: about 0.81 < 0.9) is held: no version is active
        v1 = await acme.register(BAR_TASK, "acme-few", model=logreg(60), validation=(x, y), min_accuracy=0.9)
        assert v1.admitted["min_accuracy"] == 0.9
        done1 = await v1.wait(poll_s=5.0, timeout=240)
        best1 = max(v["accuracy"] for v in done1["variants"])
        assert best1 < 0.9, done1
        assert (done1["state"], done1["version"], done1["version_state"]) == ("done", 1, "held"), done1
        assert done1["version_note"] == f"best {best1:.4g} < declared 0.9", done1
        assert done1["min_accuracy"] == 0.9
        got = await acme.versions(BAR_TASK)
        assert got["active"] is None and got["traffic"] == {} and got["min_accuracy"] == 0.9, got
        assert [(v["version"], v["state"], v["share"]) for v in got["versions"]] == [(1, "held", 0.0)], got
        assert {m.version: m.share for m in await catalog.list_variants(BAR_TASK)} == {1: 0.0}
        # ... and not served: a query is refused (once the agent's view has the variants: bounded), a pin is answered
        end, refusal = time.monotonic() + 30.0, None
        while time.monotonic() < end:
            try:
                served = await _variant(client, x[:4], BAR_TASK)
                pytest.fail(f"a held first version answered: {served}")
            except NoRoute as exc:
                refusal = exc
                if "no version taking traffic" in str(exc):
                    break
                await asyncio.sleep(0.3)  # a table built before the catalog said every version is held
            except UnknownTask:  # the view has not seen the variants yet
                await asyncio.sleep(0.3)
        assert refusal is not None and "no version taking traffic" in str(refusal), refusal
        # pinned: answered once a site can load the held version (bounded: nothing places it ahead of demand)
        end, pinned = time.monotonic() + 60.0, None
        while pinned is None:
            try:
                pinned = await client.infer(BAR_TASK, x[:4], latency_ms=3000.0, timeout=15.0, version=1)
            except NoRoute:
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.5)
        assert str(pinned.variant).startswith("acme-few."), pinned.variant

        # a version above the bar (every row: about 0.97; the bar is kept, this registration declares none) moves
        v2 = await acme.register(BAR_TASK, "acme-all", model=logreg(len(split.x_train)), validation=(x, y))
        assert v2.admitted["min_accuracy"] is None
        done2 = await v2.wait(poll_s=5.0, timeout=240)
        best2 = max(v["accuracy"] for v in done2["variants"])
        assert (done2["version"], done2["version_state"]) == (2, "active"), done2
        assert done2["version_note"] == f"best {best2:.4g} >= declared 0.9", done2
        got = await acme.versions(BAR_TASK)
        assert got["active"] == 2 and got["traffic"] == {"2": 1.0}, got
        assert {v["version"]: v["state"] for v in got["versions"]} == {1: "held", 2: "active"}, got
        await _first_answer(client, x[:4], "acme-all", task=BAR_TASK)

        # a later version below the bar (40 rows: about 0.72) is held; traffic stays on version 2
        v3 = await acme.register(BAR_TASK, "acme-fewer", model=logreg(40), validation=(x, y))
        done3 = await v3.wait(poll_s=5.0, timeout=240)
        best3 = max(v["accuracy"] for v in done3["variants"])
        assert (done3["version"], done3["version_state"]) == (3, "held"), done3
        assert done3["version_note"] == f"best {best3:.4g} < declared 0.9", done3
        got = await acme.versions(BAR_TASK)
        assert got["active"] == 2 and got["traffic"] == {"2": 1.0}, got
        assert {v["version"]: v["state"] for v in got["versions"]} == {1: "held", 2: "active", 3: "held"}, got
        assert {m.version: m.share for m in await catalog.list_variants(BAR_TASK)} == {1: 0.0, 2: 1.0, 3: 0.0}
        for _ in range(20):
            assert (await _variant(client, x[:4], BAR_TASK)).startswith("acme-all.")
        # a split ending on one version (2) retires the others: each version keeps the note that says why it moved
        # or was held
        notes = {v["version"]: v.get("note") for v in got["versions"]}
        await acme.traffic(BAR_TASK, {2: 1.0})
        after = await acme.versions(BAR_TASK)
        assert {v["version"]: v["state"] for v in after["versions"]} == {1: "retiring", 2: "active", 3: "retiring"}
        assert {v["version"]: v.get("note") for v in after["versions"]} == notes, (notes, after)
