"""A site the scheduler leader assigned a chunk of tenant T's job fetches T's private variant from the HTTPS
variant store; a site without one is refused (403); a removed assignment keeps its right for a grace only. And
etcd RBAC: a site certificate cannot write ``jobassign/`` (it would grant itself any variant), the scheduler's
can. Real etcd, real TLS on loopback."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from core_scheduler.policy.jobs import Assigned
from core_scheduler.state.job_assign import JobAssignments
from core_scheduler.state.jobs import JobBook
from edge_agent.chunks import REFUSED_BACKOFF_S, ChunkWorker
from mesh.errors import PermissionDenied
from mesh.etcd.channels import StorePermissionDenied
from mesh.etcd.keys import assign_key, claim_key
from mesh.etcd.rbac import apply, plan
from mesh.etcd.server import EmbeddedEtcd
from mesh.jobspec import JobRecord
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.integration.test_blob_server_tls import _client, _get
from tests.integration.test_etcd_rbac import PREFIX, SITES, _connect, mesh_etcd  # noqa: F401  # the fixture
from variant_store.access import StoreTls
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.fetch import fetch_blob
from variant_store.job_grants import JobGrants
from variant_store.meta import VariantMeta
from variant_store.server import VariantStoreServer

pytestmark = pytest.mark.integration

TASK = "text-classification"
HEAD_A, HEAD_A2, BACKBONE = os.urandom(3000), os.urandom(2500), os.urandom(5000)
JOB, OTHER_JOB = "a" * 32, "b" * 32
EDGE1, EDGE2, TENANT_B = Identity("site", "edge-1"), Identity("site", "edge-2"), Identity("tenant", "tenant-b")
GRACE_S = 1.5


def _meta(variant: str, digest: str, size: int, owner: str, base: str | None = None) -> VariantMeta:
    return VariantMeta(task=TASK, family="minilm", variant_id=variant, format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest=digest, size_bytes=size, accuracy=0.9, owner=owner,
                       shared_base_digest=base)


@pytest.fixture
async def served(tmp_path: Path, store: Any) -> AsyncIterator[tuple[VariantStoreServer, LocalPki, dict[str, str]]]:
    pki = LocalPki.under(tmp_path / "home")
    pki.init()
    pki.issue(Identity("store", "store"), addresses=["127.0.0.1"])
    for ident in (EDGE1, EDGE2, TENANT_B):
        pki.issue(ident)
    blobs = BlobStore(tmp_path / "blobs")
    digests = {"a": blobs.put_bytes(HEAD_A), "a2": blobs.put_bytes(HEAD_A2), "base": blobs.put_bytes(BACKBONE)}
    cat = Catalog(store)
    # tenant-a's private heads on a private backbone: no placement anywhere names them
    await cat.put_variant(_meta("head-a", digests["a"], len(HEAD_A), "tenant-a", digests["base"]))
    await cat.put_variant(_meta("head-a2", digests["a2"], len(HEAD_A2), "tenant-a", digests["base"]))
    tls = StoreTls(pki.paths, Identity("store", "store"), interval_s=0.2)
    async with JobGrants(store, grace_s=GRACE_S) as grants:
        server = VariantStoreServer(blobs, cat, host="127.0.0.1", tls=tls, announce=False, job_grants=grants)
        async with server:
            yield server, pki, digests


async def test_an_assigned_site_fetches_the_jobs_private_variant(served: Any, store: Any) -> None:
    server, pki, digests = served
    now = time.time()

    async def status(who: Identity, which: str) -> int:
        return (await _get(f"{server.url}/blobs/{digests[which]}", _client(pki, who)))[0]

    assert await status(EDGE1, "a") == 403  # nothing grants it yet
    book = JobAssignments(store)
    # the leader's write (as core_scheduler.job_planner does it): chunk 0 of tenant-a's job on head-a to edge-1
    assert await book.write({(JOB, 0): Assigned("edge-1", now, now)}, [], [], 7,
                            {JOB: ("tenant-a", TASK, "head-a")})
    # a record naming head-a2 for tenant-b's job: the catalog says head-a2 is tenant-a's, so it grants nothing
    assert await book.write({(OTHER_JOB, 0): Assigned("edge-2", now, now)}, [], [], 7,
                            {OTHER_JOB: ("tenant-b", TASK, "head-a2")})
    assert (await book.read(JOB))[0].site == "edge-1"  # the scheduler still reads it as an assignment
    got = await fetch_blob(server.url, digests["a"], pki.paths.ca_cert.parent / "dl" / "a",
                           ssl=_client(pki, EDGE1), timeout=10)
    assert got.read_bytes() == HEAD_A
    assert await status(EDGE1, "base") == 200  # the head's backbone comes with it
    assert await status(EDGE1, "a2") == 403    # tenant-a's other variant does not
    assert await status(EDGE2, "a") == 403     # another site has no assignment
    assert await status(EDGE2, "a2") == 403    # a record naming another tenant's variant grants nothing
    assert await status(TENANT_B, "a") == 403
    with pytest.raises(PermissionDenied):
        await fetch_blob(server.url, digests["a"], pki.paths.ca_cert.parent / "dl" / "a-2",
                         ssl=_client(pki, EDGE2), timeout=10)
    catalog = (await _get(f"{server.url}/catalog", _client(pki, EDGE1)))[1]
    assert b"head-a\"" in catalog and b"head-a2" not in catalog

    # the chunk is claimed: the leader removes the assignment; the fetch right after still works, for the grace
    assert await book.write({}, [(JOB, 0)], [], 7)
    assert await status(EDGE1, "a") == 200
    deadline = time.monotonic() + 10 * GRACE_S  # bounded: the watch delivers the removal, then the grace runs out
    while await status(EDGE1, "a") == 200:
        assert time.monotonic() < deadline, "the grace never ended"
        await asyncio.sleep(0.3)
    assert await status(EDGE1, "a") == 403


async def test_only_the_scheduler_may_write_assignments(mesh_etcd: tuple[EmbeddedEtcd, LocalPki]) -> None:  # noqa: F811
    srv, pki = mesh_etcd
    rbac = plan(PREFIX, sites=SITES, schedulers=["s1"], admins=["op"], root_admins=["root-op"])
    async with await _connect(srv, pki, "admin", "root-op") as root:
        await apply(root, rbac)
    value = {"schema": 1, "site": "edge-1", "since": 1.0, "at": 1.0, "tenant": "t", "task": "k", "variant": "v"}
    async with await _connect(srv, pki, "site", "edge-1") as agent:
        with pytest.raises(StorePermissionDenied):  # a site forging its own grant
            await agent.put(assign_key(JOB, 0), value)
        with pytest.raises(StorePermissionDenied):
            await agent.delete(assign_key(JOB, 0))
        lease = await agent.lease(5)
        await agent.put(claim_key(JOB, 0), {"site": "edge-1"}, lease=lease)  # its claims under jobs/ still work
        await lease.revoke()
    async with await _connect(srv, pki, "scheduler", "s1") as sched:
        await sched.put(assign_key(JOB, 0), value)
        async with await _connect(srv, pki, "site", "edge-1") as agent:
            assert (await agent.get(assign_key(JOB, 0))) is not None  # sites read their assignments
        await sched.delete(assign_key(JOB, 0))


class _RefusedHost:
    """A site host that fetches the variant's blob from the real HTTPS store with a site certificate (no
    assignment, no placement: the store answers 403), as VariantHost's BlobCache does before loading."""

    def __init__(self, url: str, ssl: Any, dest: Path) -> None:
        self.url, self.ssl, self.dest, self.fetches = url, ssl, dest, 0

    async def ensure(self, meta: VariantMeta, isolated_for: str = "") -> Any:
        self.fetches += 1
        await fetch_blob(self.url, meta.blob_digest, self.dest / meta.blob_digest, ssl=self.ssl, timeout=10)
        raise AssertionError("the store served a blob nothing grants")


class _Data:
    def __init__(self, path: Path) -> None:
        self.path = path

    async def get_file(self, tenant: str, digest: str, path: Path, *, max_bytes: int) -> Path:
        return self.path


async def test_a_refused_site_releases_the_chunk_and_leaves_the_job_alone(served: Any, store: Any,
                                                                           tmp_path: Path) -> None:
    server, pki, _ = served
    meta = next(m for m in await Catalog(store).list_variants(TASK) if m.variant_id == "head-a")
    (tmp_path / "in.jsonl").write_text('"hello"\n', encoding="utf-8")
    view = type("V", (), {"topology": None, "live": {}, "variants": {TASK: {"head-a": meta}}})()
    host = _RefusedHost(server.url, _client(pki, EDGE2), tmp_path / "dl")
    worker = ChunkWorker("edge-2", store, cast(Any, view), cast(Any, host), cast(Any, _Data(tmp_path / "in.jsonl")),
                         tmp_path / "work", lambda: False)
    book = JobBook(store)
    job = JobRecord(job_id=JOB, task=TASK, tenant="tenant-a", min_accuracy=0.0, deadline=2e9, input_digest="c" * 64,
                    rows=1, input_format="jsonl", chunk_rows=1, variant="head-a", created=time.time())
    await book.create(job)
    try:
        v = await book.view(JOB)
        assert v is not None
        assert await worker._take(v, v.chunks[0]) is False  # refused: claimed, fetched, 403, released
        assert host.fetches == 1
        after = await book.view(JOB)
        assert after is not None and after.chunks[0].claimed_by is None and after.chunks[0].chunk.state == "queued"
        assert JOB in worker._refused and worker._refused[JOB] - time.monotonic() > REFUSED_BACKOFF_S - 5
        looked: list[str] = []
        real_view = worker.book.view

        async def spy(job_id: str) -> Any:
            looked.append(job_id)
            return await real_view(job_id)

        worker.book.view = spy  # type: ignore[method-assign]
        for _ in range(3):  # polls within the back-off: the job is not even read, let alone claimed
            assert await worker.run_once() is False
        assert looked == [] and host.fetches == 1
        worker._refused[JOB] = time.monotonic() - 1  # the back-off over: the job is looked at again
        await worker.run_once()
        assert looked == [JOB]
    finally:  # never started: its claims' lease is ours to end
        if worker._lease is not None:
            await worker._lease.revoke()
