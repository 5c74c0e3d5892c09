"""Issue 34, item 0, on a real etcd: one bad catalog entry never breaks the mesh.

The issue's sequence: a model owner registers task ``my-digits`` with family ``mlp-tiny``, whose variant ids are
``digit-classification``'s. Now the registration is refused (exit 2, nothing written). A duplicate id and a
garbage value written straight into etcd are skipped and reported by every reader: the snapshot builder (what
agents route on), the scheduler's placement rounds (which go on placing the other tasks, the new one included),
``variants list`` (marked broken, with the reason) and the console's state; ``variants remove`` takes them, and
then the whole new task, out, and placement drops what was removed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from console.scrape import Scraper
from console.state import ConsoleState
from core_scheduler.scheduler import Scheduler, SchedulerConfig
from core_scheduler.state.heartbeat import DemandSample, Heartbeat
from core_scheduler.state.snapshot import SnapshotBuilder
from core_scheduler.state.view import MeshView
from mesh.errors import CatalogError
from mesh.etcd import messages as rpc
from mesh.etcd.keys import CATALOG, MODELS, catalog_key, live_key, model_key, placement_key
from mesh.etcd.ops import Put, chunk_ops
from mesh.etcd.store import Store
from mesh.types import TaskSignature, TensorSpec
from tests.helpers.waiting import eventually
from tiermesh.cli.main import EXIT_BAD_INPUT, EXIT_OK, main
from topology.schema import Hardware, Link, Site, Topology
from topology.store_io import desired_state
from variant_store.catalog import Catalog, RegisteredModel
from variant_store.meta import LatencyStats, Profile, VariantMeta

pytestmark = pytest.mark.integration

DIGITS, MINE = "digit-classification", "my-digits"
TINY_IDS = ("mlp-tiny.onnx.fp16", "mlp-tiny.onnx.fp32")
MINE_ID = "my-mlp.onnx.fp32"
SIG_IN = (TensorSpec("x", "float32", (-1, 64)),)
SIG_OUT = (TensorSpec("logits", "float32", (-1, 10)),)


@pytest.fixture(autouse=True)
def _quiet_cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr("tiermesh.cli.main.configure", lambda *a, **k: None)  # keep pytest's log capture
    yield


def _meta(task: str, vid: str) -> VariantMeta:
    prof = Profile(hardware_class="cpu", load_ms=5.0, latency={1: LatencyStats(1.0, 2.0)}, peak_memory_bytes=1 << 20)
    return VariantMeta(task=task, family=vid.split(".")[0], variant_id=vid, format="onnx",
                       precision="fp16" if "fp16" in vid else "fp32", runtime="onnxruntime",
                       blob_digest=("c" if task == DIGITS else "d") * 64, size_bytes=1 << 20, accuracy=0.97,
                       profiles={"cpu": prof})


def _topology() -> Topology:
    hw = Hardware(cpu_cores=4, memory_mb=8192, price_per_hour=0.3)
    sites = {"c": Site("c", "core", "r", 0.0, 0.0, Hardware(cpu_cores=16, memory_mb=65536, price_per_hour=2.0)),
             "e0": Site("e0", "edge", "r", 0.0, 0.0, hw)}
    return Topology(sites=sites, links=(Link("c", "e0", 1.0, 100.0),))


def _model_files(tmp: Path) -> tuple[Path, Path]:
    """A small ONNX classifier of the digits signature (64 floats in, 10 logits out) and a labelled npz."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((10, 64)).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros(10, np.float32), "b")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "b"], ["logits"], transB=1)], "tiny",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx_path, npz = tmp / "mine.onnx", tmp / "val.npz"
    onnx_path.write_bytes(model.SerializeToString())
    np.savez(npz, x=rng.random((40, 64), dtype=np.float32), y=rng.integers(0, 10, 40), calib_count=np.asarray(10))
    return onnx_path, npz


async def _put_raw(store: Store, key: str, raw: bytes) -> None:
    """``raw`` as it is (``Store.put`` writes JSON only), as an operator's ``etcdctl put`` would."""
    req = rpc.PutRequest(key=store.prefix.encode() + key.encode(), value=raw)
    await store.call(f"put {key!r}", lambda m, t: m.kv.Put(req, timeout=t))


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = await asyncio.to_thread(main, list(argv))  # main runs its own event loop
    out = capsys.readouterr()
    return rc, out.out, out.err


async def _seed(store: Store) -> None:
    """The committed family as it is catalogued, plus two live sites; demand for the new task at the edge."""
    ops: list[Any] = [Put(k, v) for k, v in desired_state(_topology()).items()]
    ops += [Put(catalog_key(DIGITS, vid), _meta(DIGITS, vid).to_json()) for vid in TINY_IDS]
    for part in chunk_ops(ops):
        await store.txn([], part)
    catalog = Catalog(store)
    await catalog.put_task(TaskSignature(DIGITS, SIG_IN, SIG_OUT))
    await catalog.put_model(RegisteredModel(DIGITS, "mlp-tiny", "c" * 64, "e" * 64))
    lease = await store.lease(60)
    demand = (DemandSample(MINE, "fast", "public", 5.0, 50.0, 0.5), DemandSample(DIGITS, "fast", "public", 5.0, 50.0,
                                                                                 0.5))
    for site in ("c", "e0"):
        hb = Heartbeat(site=site, hardware_class="cpu", capacity=8, model_memory_budget_bytes=1 << 30,
                       demand=demand if site == "e0" else ())
        await store.put(live_key(site), hb.to_json(), lease=lease)


async def _placed(store: Store, site: str) -> set[str]:
    kv = await store.get(placement_key(site))
    return {v["variant_id"] for v in kv.value["variants"]} if kv is not None else set()


async def test_a_bad_entry_is_refused_skipped_reported_and_removed(
        store: Store, etcd_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    common = ["--etcd", etcd_server.url, "--prefix", store.prefix, "--home", str(tmp_path / "home")]
    blobs = tmp_path / "home" / "blobs"
    await _seed(store)
    onnx_path, npz = _model_files(tmp_path)

    # 1. the registration: refused, with what to do, and nothing written (no key, no blob)
    rc, _, err = await _cli(capsys, "variants", "register", "--task", MINE, "--family", "mlp-tiny",
                            "--model", str(onnx_path), "--validation", str(npz), *common)
    assert rc == EXIT_BAD_INPUT, err
    assert f"'{DIGITS}'" in err and "'mlp-tiny'" in err and "variants remove" in err
    assert await store.get_prefix(f"{CATALOG}{MINE}/") == [] and await store.get_prefix(f"{MODELS}{MINE}/") == []
    assert not blobs.exists() or not any(p.is_file() for p in blobs.rglob("*"))
    with pytest.raises(SystemExit):
        main(["variants", "register", "--help"])
    help_out = capsys.readouterr().out
    assert "mlp-tiny" not in help_out and "cnn-small" not in help_out  # the example is no family in use

    # ... under a family of its own it goes through
    rc, _, err = await _cli(capsys, "variants", "register", "--task", MINE, "--family", "my-mlp",
                            "--model", str(onnx_path), "--validation", str(npz), *common)
    assert rc == EXIT_OK, err
    await Catalog(store).put_variant(_meta(MINE, MINE_ID))  # as `variants build` would catalog it
    # ... and catalogue a colliding id through the API is refused too
    with pytest.raises(CatalogError, match="already task"):
        await Catalog(store).put_variant(_meta(MINE, TINY_IDS[0]))
    # a colliding registration from before the check (written by hand here): its build is refused before any work
    await store.put(model_key(MINE, "mlp-tiny"), RegisteredModel(MINE, "mlp-tiny", "c" * 64, "e" * 64).to_json())
    rc, _, err = await _cli(capsys, "variants", "build", "--task", MINE, "--repeats", "1", *common)
    assert rc == EXIT_BAD_INPUT and f"'{DIGITS}'" in err, err
    assert {kv.key for kv in await store.get_prefix(f"{CATALOG}{MINE}/")} == {
        catalog_key(MINE, "_task"), catalog_key(MINE, MINE_ID)}

    # 2. what slips past registration: a duplicate id and garbage, straight into etcd
    dup, junk = catalog_key(MINE, TINY_IDS[0]), catalog_key(MINE, "junk")
    await _put_raw(store, dup, json.dumps(_meta(MINE, TINY_IDS[0]).to_json()).encode())
    await _put_raw(store, junk, b"\x00not json{")

    view = MeshView(store, "probe", debounce_s=0.02)
    sched = Scheduler(store, SchedulerConfig(candidate_id="a", interval_s=0.2, proactive=False))
    console = ConsoleState(store, Scraper(None))
    caplog.set_level(logging.WARNING)
    await view.start()
    await sched.start()
    await console.view.start()
    try:
        # the snapshot builder (what each agent routes on) keeps the first claim and serves the new task
        snap = SnapshotBuilder(view).build()
        assert snap is not None
        assert {v.variant_id for v in snap.variants[DIGITS]} == set(TINY_IDS)
        assert [v.variant_id for v in snap.variants[MINE]] == [MINE_ID]
        assert snap.variant_by_id[TINY_IDS[0]].task == DIGITS
        assert f"'{DIGITS}'" in view.rejected[dup] and junk in view.rejected
        # placement rounds succeed and place the new task where its demand is
        await eventually(lambda: _has(store, "e0", MINE_ID), 20, "the new task placed at the edge")
        rounds = sched.rounds
        await eventually(lambda: _true(sched.rounds >= rounds + 5), 20, "five more placement rounds")
        assert not [r for r in caplog.records if "placement round" in r.getMessage()]
        # one warning per bad key, not one per rebuild or per round
        per_key = [r for r in caplog.records if "ignoring a bad value" in r.getMessage() and repr(dup) in
                   r.getMessage()]
        assert 1 <= len(per_key) <= 3, [r.getMessage() for r in per_key]

        # 3. reported: `variants list` marks both broken with the reason; so does the console's state
        rc, out, _ = await _cli(capsys, "variants", "list", "--json", *common)
        rows = json.loads(out)
        broken = {r["key"]: r for r in rows if r.get("broken")}
        assert set(broken) == {dup, junk} and f"'{DIGITS}'" in broken[dup]["reason"]
        assert "malformed" in broken[junk]["reason"]
        assert {(r["task"], r["id"]) for r in rows if not r.get("broken")} == {
            (DIGITS, TINY_IDS[0]), (DIGITS, TINY_IDS[1]), (MINE, MINE_ID)}
        rc, out, _ = await _cli(capsys, "variants", "list", *common)
        assert rc == EXIT_OK and f"BROKEN {dup}" in out and f"BROKEN {junk}" in out
        await eventually(lambda: _true(len(console.build()["catalog_broken"]) == 2), 10, "the console reports both")

        # 4. removed: unconfirmed does nothing, what is not there exits 2, the rest goes cleanly
        rc, _, err = await _cli(capsys, "variants", "remove", "--task", MINE, "--variant", "junk", *common)
        assert rc == EXIT_BAD_INPUT and "--yes" in err and await store.get(junk) is not None
        rc, _, err = await _cli(capsys, "variants", "remove", "--task", MINE, "--variant", "nope", "--yes", *common)
        assert rc == EXIT_BAD_INPUT and "nothing to remove" in err
        for vid in ("junk", TINY_IDS[0]):
            rc, out, err = await _cli(capsys, "variants", "remove", "--task", MINE, "--variant", vid, "--yes",
                                      *common)
            assert rc == EXIT_OK and "removed variant" in out, err
        await eventually(lambda: _true(not any(k.startswith(CATALOG) for k in view.rejected)), 10, "a clean view")
        rc, out, _ = await _cli(capsys, "variants", "list", "--json", *common)
        assert not [r for r in json.loads(out) if r.get("broken")]
        assert (await Catalog(store).read()).broken == []
        await eventually(lambda: _true(console.build()["catalog_broken"] == []), 10, "a clean console")

        # the whole new task goes, and placement drops its variant on the watch
        rc, out, err = await _cli(capsys, "variants", "remove", "--task", MINE, "--yes", "--json", *common)
        assert rc == EXIT_OK, err
        gone = json.loads(out)
        assert catalog_key(MINE, MINE_ID) in gone["keys"] and f"{MODELS}{MINE}/my-mlp" in gone["keys"]
        assert gone["unreferenced_blobs"] == ["d" * 64]
        assert await store.get_prefix(f"{CATALOG}{MINE}/") == [] and await store.get_prefix(f"{MODELS}{MINE}/") == []
        await eventually(lambda: _true(MINE_ID not in view.variants.get(MINE, {})), 10, "the view drops it")
        await eventually(lambda: _lacks(store, "e0", MINE_ID), 20, "placement drops the removed variant")
        rc, _, err = await _cli(capsys, "variants", "remove", "--task", MINE, "--yes", *common)
        assert rc == EXIT_BAD_INPUT and "nothing to remove" in err
        assert {v.variant_id for v in (SnapshotBuilder(view).build() or snap).variants[DIGITS]} == set(TINY_IDS)
    finally:
        await console.view.stop()
        await sched.stop()
        await view.stop()


async def _true(value: bool) -> bool:
    return value


async def _has(store: Store, site: str, vid: str) -> bool:
    return vid in await _placed(store, site)


async def _lacks(store: Store, site: str, vid: str) -> bool:
    return vid not in await _placed(store, site)
