"""The variant store's build loop (``variant_store.tenant_builds``) against real etcd and a real data area: what it
claims and what it leaves, hostile records, a takeover of a build whose store died, and the ownership rule checked
again in the store (two doors may both have admitted a registration for one new task)."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from core_scheduler.state.builds import BuildBook
from mesh.buildspec import BuildRequest, BuildState
from mesh.etcd.keys import build_key, build_state_key
from mesh.etcd.store import Store
from tests.integration.test_quota_flood import TASK, _catalog
from tests.integration.test_tenant_models import logreg_onnx
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.data_area import DataArea
from variant_store.tenant_builds import BuildOptions, TenantBuilder

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _req(task: str = "acme-t", model: str = "0" * 64, val: str = "1" * 64, created: float | None = None,
         tenant: str = "acme") -> BuildRequest:
    return BuildRequest(build_id=uuid.uuid4().hex, tenant=tenant, task=task, family=f"f{uuid.uuid4().hex[:6]}",
                        model_digest=model, model_bytes=1, validation_digest=val, validation_bytes=1, rows=2,
                        door="edge-1", created=time.time() if created is None else created)


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _stored(area: DataArea, tenant: str, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    await area.receive(tenant, digest, _chunks(data))
    return digest


async def _state(store: Store, req: BuildRequest) -> BuildState | None:
    return (await BuildBook(store).state(req.build_id))[0]


async def test_the_loop_claims_what_it_may_and_refuses_what_it_cannot_read(store: Store, tmp_path: Path) -> None:
    area = DataArea(tmp_path / "data")
    builder = TenantBuilder(Catalog(store), BlobStore(tmp_path / "blobs"), area,
                            options=BuildOptions(kinds=("onnx.fp32",), repeats=2, stale_s=60.0))
    book = BuildBook(store)
    # garbage at a well-formed key: failed "unreadable" under the key's tenant; nothing runs
    bad_id = uuid.uuid4().hex
    await store.put(build_key("acme", bad_id), {"schema": 1, "build_id": [[[["deep"]]]]})
    # a request filed under another tenant than it names: unreadable too (a site wrote it wrongly)
    misfiled = _req(tenant="acme")
    await store.put(build_key("globex", misfiled.build_id), misfiled.to_json())
    assert await builder.run_once() is False
    st, _ = await book.state(bad_id)
    assert st is not None and (st.state, st.reason, st.tenant) == ("failed", "unreadable", "acme")
    st, _ = await book.state(misfiled.build_id)
    assert st is not None and (st.reason, st.tenant) == ("unreadable", "globex")
    assert await book.view("acme", misfiled.build_id) is None  # acme never sees it as its own

    # a build another store is running (fresh) is left alone; one untouched past stale_s is taken over
    fresh, stale = _req(created=1.0), _req(created=2.0)
    for r in (fresh, stale):
        await book.create(r)
    now = time.time()
    await store.put(build_state_key(fresh.build_id),
                    BuildState(fresh.build_id, "acme", "running", worker="other", started=now, updated=now).to_json())
    await store.put(build_state_key(stale.build_id),
                    BuildState(stale.build_id, "acme", "running", worker="dead", started=now - 600,
                               updated=now - 600).to_json())
    assert await builder.run_once() is True
    st = await _state(store, stale)
    assert st is not None and st.worker == builder.worker and (st.state, st.reason) == ("failed", "missing_input")
    st = await _state(store, fresh)
    assert st is not None and (st.state, st.worker) == ("running", "other")
    assert await builder.run_once() is False  # finished builds never run again; the fresh claim is still theirs


async def test_the_store_refuses_a_task_another_owner_holds(store: Store, tmp_path: Path) -> None:
    """Two doors can both admit a new task for two tenants (or acme a public task's name raced in): the store
    checks ownership again before it registers anything."""
    area, blobs = DataArea(tmp_path / "data"), BlobStore(tmp_path / "blobs")
    await _catalog(store, blobs)  # TASK is the public catalog's
    catalog = Catalog(store)
    builder = TenantBuilder(catalog, blobs, area, options=BuildOptions(kinds=("onnx.fp32",), repeats=2))
    buf = tmp_path / "v.npz"
    np.savez(buf, x=np.zeros((8, 64), np.float32), y=np.arange(8) % 10)
    req = _req(task=TASK, model=await _stored(area, "acme", logreg_onnx()),
               val=await _stored(area, "acme", buf.read_bytes()))
    await BuildBook(store).create(req)
    assert await builder.run_once() is True
    st = await _state(store, req)
    assert st is not None and (st.state, st.reason) == ("failed", "task_owned") and "public" in st.error
    assert {m.owner for m in await catalog.list_models(TASK)} <= {"public"}
    assert {m.owner for m in await catalog.list_variants(TASK)} == {"public"}
