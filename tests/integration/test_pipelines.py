"""Pipelines (issue 33, item 2) with real etcd and real ONNX Runtime sessions: graphs registered through the CLI
and the catalog functions, bad ones refused with nothing written, the view following ``pipelines/``, and a
Sequence and a Switch served through a real ``SiteDataPlane`` whose routing table is built from that view, each
stage an ordinary query of its task routed by the mesh's policy.

The models: the committed digits backbone with its digit and parity heads (``tests.helpers_backbone``), the
standalone ``mlp-wide`` digits model, and a one-node ``digits-prep`` model (x -> y = 2 x) written here, so that a
Sequence feeds one stage's output to the next stage's input by another name."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from core_scheduler.policy.modes import make_router
from core_scheduler.state.heartbeat import Heartbeat
from core_scheduler.state.snapshot import SnapshotBuilder
from core_scheduler.state.view import MeshView
from edge_agent.demand import DemandMeter
from edge_agent.pipeline_exec import REASON
from edge_agent.site_dataplane import SiteDataPlane
from mesh.errors import ImpossibleSLO, MeshError, PipelineRefused, UnknownTask
from mesh.etcd.keys import pipeline_key
from mesh.etcd.store import Store
from mesh.tracecontext import new_traceparent
from mesh.types import SLO, InferRequest, TaskSignature, TensorSpec
from mesh.v2.params import cascade_stages, response_parameters
from mesh.zmq.client import ZmqClient
from tests.helpers.waiting import eventually
from tests.helpers_backbone import DIGITS, head_meta, model_meta, seeded_host
from tests.helpers_models import digits_split
from tiermesh.cli.main import EXIT_BAD_INPUT, EXIT_OK, main
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.catalog import Catalog
from variant_store.meta import LatencyStats, Profile, VariantMeta
from variant_store.pipeline_catalog import Graph, read_pipelines, register_pipeline, remove_pipeline

pytestmark = pytest.mark.integration

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
SITE = "edge-fra-1"
X = (TensorSpec("x", "float32", (-1, 64)),)


def _prep_onnx(dest: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y"])], "prep",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])],
                              initializer=[two])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(dest))
    return dest


def _profiled(meta: VariantMeta, ms: float) -> VariantMeta:
    return dataclasses.replace(meta, profiles={"cpu": Profile("cpu", 5.0, {1: LatencyStats(ms, ms),
                                                                          32: LatencyStats(ms * 4, ms * 4)}, 1 << 20)})


async def _catalog(store: Store, host_cache: Path, tmp: Path) -> dict[str, VariantMeta]:
    prep = _prep_onnx(tmp / "prep.onnx")
    digest = hashlib.sha256(prep.read_bytes()).hexdigest()
    (host_cache / f"{digest}.onnx").write_bytes(prep.read_bytes())
    metas = {
        "digit-classification": _profiled(head_meta("head-digits.onnx.fp32"), 0.2),
        "digit-parity": _profiled(head_meta("head-parity.onnx.fp32", "head-parity.onnx", task="digit-parity"), 0.2),
        "digits-wide": _profiled(dataclasses.replace(model_meta("mlp-wide.onnx.fp32", "mlp-wide.onnx"),
                                                     task="digits-wide"), 0.3),
        "digits-prep": _profiled(VariantMeta(
            task="digits-prep", family="prep", variant_id="prep.onnx.fp32", format="onnx", precision="fp32",
            runtime="onnxruntime", blob_digest=digest, size_bytes=prep.stat().st_size, accuracy=1.0,
            metric="cosine", inputs=[{"name": "x", "dtype": "float32", "shape": [-1, 64]}],
            outputs=[{"name": "y", "dtype": "float32", "shape": [-1, 64]}]), 0.1),
    }
    catalog = Catalog(store)
    for task, meta in metas.items():
        outs = tuple(TensorSpec(o["name"], o["dtype"], tuple(o["shape"])) for o in meta.outputs)
        await catalog.put_task(TaskSignature(task, X, outs, meta.metric))
        await catalog.put_variant(meta)
    return metas


SEQUENCE = {"kind": "sequence", "stages": ["digits-prep", {"task": "digit-classification", "feeds": {"x": "prev.y"}}]}
SWITCH = {"kind": "switch", "select": {"task": "digit-parity", "output": "logits"},
          "table": {0: "digit-classification", 1: "digits-wide"}}


def _now(check: Any) -> Any:
    """A plain predicate as ``eventually`` wants it (awaitable)."""
    async def run() -> Any:
        return check()
    return run


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = await asyncio.to_thread(main, list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
async def plane(store: Store, tmp_path: Path) -> AsyncIterator[tuple[SiteDataPlane, dict[str, VariantMeta]]]:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    host = seeded_host(tmp_path, site=SITE)
    metas = await _catalog(store, tmp_path / "blobs", tmp_path)
    zmq = ZmqClient()
    view = MeshView(store, SITE)
    await view.start()
    try:
        await eventually(_now(lambda: view.topology is not None and len(view.variants) == 4), 10, "the view holds it")
        topo = view.topology
        assert topo is not None
        beat = Heartbeat(site=SITE, tier=topo.sites[SITE].tier, hardware_class="cpu", capacity=8,
                         memory_total_bytes=8 << 30, model_memory_budget_bytes=4 << 30)
        builder = SnapshotBuilder(view, here=SITE)

        def table() -> Any:
            snap = builder.build(local_loads=beat)
            return None if snap is None else make_router("tiermesh", snap, SITE)

        dp = SiteDataPlane(SITE, view, host, zmq, table=table, peer_endpoint=lambda s: None, demand=DemandMeter())
        yield dp, metas
    finally:
        await view.stop()
        await zmq.close()
        await host.close()


def _direct(path: Path, x: np.ndarray, base: bool = True) -> np.ndarray:
    import onnxruntime as ort

    if base:
        emb = ort.InferenceSession(str(DIGITS / "backbone.onnx")).run(None, {"x": x})[0]
        head = ort.InferenceSession(str(path))
        return np.asarray(head.run(None, {head.get_inputs()[0].name: emb})[0])
    sess = ort.InferenceSession(str(path))
    return np.asarray(sess.run(None, {sess.get_inputs()[0].name: x})[0])


async def test_register_refuse_list_remove_through_the_cli(store: Store, etcd_server: Any, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tiermesh.cli.main.configure", lambda *a, **k: None)  # keep pytest's log capture
    await _catalog(store, tmp_path, tmp_path)
    common = ["--etcd", etcd_server.url, "--prefix", store.prefix, "--home", str(tmp_path / "home")]
    graph = tmp_path / "seq.yaml"
    graph.write_text(yaml.safe_dump(SEQUENCE))
    rc, out, err = await _cli(capsys, "variants", "pipeline", "--task", "digits-seq", "--graph", str(graph), *common)
    assert rc == EXIT_OK, err
    assert "registered as pipelines/digits-seq" in out
    rc, out, _ = await _cli(capsys, "variants", "pipelines", "--json", *common)
    (entry,) = json.loads(out)
    assert entry["kind"] == "sequence" and [s["task"] for s in entry["stages"]] == ["digits-prep",
                                                                                 "digit-classification"]
    assert entry["accuracy"] is None  # never given, only measured
    # refused, nothing written: a mismatched signature, an unknown task, a cycle, a bad table
    for name, doc, words in (
            ("bad-sig", {"kind": "sequence", "stages": ["digit-classification", {"task": "digits-prep",
                                                                                  "feeds": {"x": "prev.logits"}}]},
             "cannot take"),
            ("bad-task", {"kind": "sequence", "stages": ["digits-prep", "nowhere"]}, "'nowhere' is not catalogued"),
            ("digits-loop", {"kind": "sequence", "stages": ["digits-seq", "digits-loop"]}, "would run itself"),
            ("bad-table", {**SWITCH, "table": {0: "digit-classification", 5: "digits-wide"}}, "class 5")):
        graph.write_text(yaml.safe_dump(doc))
        rc, _, err = await _cli(capsys, "variants", "pipeline", "--task", name, "--graph", str(graph), *common)
        assert rc == EXIT_BAD_INPUT and words in err, err
        assert await store.get(pipeline_key(name)) is None
    graph.write_text("kind: [unclosed")
    rc, _, err = await _cli(capsys, "variants", "pipeline", "--task", "x", "--graph", str(graph), *common)
    assert rc == EXIT_BAD_INPUT and "not YAML" in err
    rc, _, err = await _cli(capsys, "variants", "pipeline", "--task", "digits-seq", "--remove", *common)
    assert rc == EXIT_OK and await store.get(pipeline_key("digits-seq")) is None
    rc, _, err = await _cli(capsys, "variants", "pipeline", "--task", "digits-seq", "--remove", *common)
    assert rc == EXIT_BAD_INPUT and "no pipeline" in err


async def test_cycle_through_registered_pipelines_refused(store: Store, tmp_path: Path) -> None:
    await _catalog(store, tmp_path, tmp_path)
    await register_pipeline(store, "inner", Graph("sequence", (("digits-prep", None),)))
    await register_pipeline(store, "outer", Graph("sequence", (("inner", None), ("digit-classification",
                                                                                {"x": "prev.y"}))))
    with pytest.raises(PipelineRefused, match="inner -> outer -> inner") as err:
        await register_pipeline(store, "inner", Graph("sequence", (("outer", None),)))
    assert err.value.reason == "cycle"
    assert [p.task for p in (await read_pipelines(store)).pipelines] == ["inner", "outer"]
    assert (await read_pipelines(store)).pipelines[0].stages[0].task == "digits-prep"  # unchanged
    await remove_pipeline(store, "outer")
    await store.put(pipeline_key("junk"), {"task": "junk", "kind": "sequence"})
    reading = await read_pipelines(store)
    assert [p.task for p in reading.pipelines] == ["inner"] and [b.key for b in reading.broken] == ["pipelines/junk"]


async def test_sequence_served_through_the_data_plane(store: Store,
                                                      plane: tuple[SiteDataPlane, dict[str, VariantMeta]]) -> None:
    dp, _ = plane
    await register_pipeline(store, "digits-seq", Graph("sequence", (("digits-prep", None),
                                                                     ("digit-classification", {"x": "prev.y"}))))
    await eventually(_now(lambda: "digits-seq" in dp.view.pipelines), 10, "the view follows pipelines/")
    assert "digits-seq" in dp.tasks() and [i.name for i in dp.task_signature("digits-seq").inputs] == ["x"]
    x = np.ascontiguousarray(digits_split().x_val[:5], dtype=np.float32)
    resp = await dp.infer(InferRequest.entering("digits-seq", {"x": x}, SLO(latency_ms=5000.0)))
    want = _direct(DIGITS / "head-digits.onnx", 2 * x)
    np.testing.assert_allclose(resp.outputs["logits"], want, rtol=1e-4, atol=1e-4)
    assert resp.reason == REASON and resp.cascade == "digits-seq" and not resp.late
    assert [(s.stage, s.task, s.site, s.variant, s.rows) for s in resp.stages] == [
        (1, "digits-prep", SITE, "prep.onnx.fp32", 5), (2, "digit-classification", SITE, "head-digits.onnx.fp32", 5)]
    params = response_parameters(resp)  # each stage's task, site and variant survive the V2 parameters
    assert [(s.stage, s.task, s.site, s.variant) for s in cascade_stages(params)] == [
        (1, "digits-prep", SITE, "prep.onnx.fp32"), (2, "digit-classification", SITE, "head-digits.onnx.fp32")]
    assert dp.served >= 2  # each stage an ordinary query of its task, served here
    # a traced query: each stage's hop records, marked with its stage and task, in the reply and the door's store
    traced = InferRequest.entering("digits-seq", {"x": x}, SLO(latency_ms=5000.0))
    traced.traceparent = new_traceparent()
    resp = await dp.infer(traced)
    assert resp.trace and {(r["pipeline_stage"], r["stage_task"]) for r in resp.trace} == {
        (1, "digits-prep"), (2, "digit-classification")}
    kept = dp.traces.get(traced.request_id)
    assert kept is not None and kept["task"] == "digits-seq"
    # bad input is the pipeline's signature's error, and nothing ran
    with pytest.raises(MeshError, match="x"):
        await dp.infer(InferRequest.entering("digits-seq", {"x": np.zeros((1, 3), np.float32)},
                                             SLO(latency_ms=5000.0)))
    # an unmeasured pipeline meets no accuracy floor: refused when asked, else best effort
    with pytest.raises(ImpossibleSLO, match="never measured"):
        await dp.infer(InferRequest.entering("digits-seq", {"x": x}, SLO(5000.0, 0.5, prefer="refuse")))
    resp = await dp.infer(InferRequest.entering("digits-seq", {"x": x}, SLO(5000.0, 0.5)))
    assert resp.best_effort


async def test_switch_served_row_by_row(store: Store, plane: tuple[SiteDataPlane, dict[str, VariantMeta]]) -> None:
    dp, _ = plane
    await register_pipeline(store, "digits-switch", Graph(
        "switch", (("digit-parity", None),), "logits", ((0, "digit-classification"), (1, "digits-wide")),
        (("digit-classification", None), ("digits-wide", None))), accuracy=0.9, heldout_rows=100,
        stage_accuracy={"digit-parity": 0.95})
    await eventually(_now(lambda: "digits-switch" in dp.view.pipelines), 10, "the view follows pipelines/")
    x = np.ascontiguousarray(digits_split().x_val[:12], dtype=np.float32)
    parity = _direct(DIGITS / "head-parity.onnx", x).argmax(1)
    assert 0 < parity.sum() < len(parity), "the rows pick both branches"
    resp = await dp.infer(InferRequest.entering("digits-switch", {"x": x}, SLO(5000.0, 0.85, prefer="refuse")))
    want = _direct(DIGITS / "head-digits.onnx", x)
    want[parity == 1] = _direct(DIGITS / "mlp-wide.onnx", x[parity == 1], base=False)
    np.testing.assert_allclose(resp.outputs["logits"], want, rtol=1e-4, atol=1e-4)
    assert resp.accuracy == 0.9 and not resp.best_effort
    sel, *branches = resp.stages
    assert (sel.stage, sel.variant, sel.rows) == (1, "head-parity.onnx.fp32", 12)
    assert sorted((b.stage, b.variant, b.rows) for b in branches) == sorted([
        (2, "head-digits.onnx.fp32", int((parity == 0).sum())), (2, "mlp-wide.onnx.fp32", int(parity.sum()))])
    # the measured accuracy below the floor asked: refused
    with pytest.raises(ImpossibleSLO, match=r"measured 0\.9000"):
        await dp.infer(InferRequest.entering("digits-switch", {"x": x}, SLO(5000.0, 0.95, prefer="refuse")))


async def test_a_failing_stage_fails_the_query_naming_it(
        store: Store, plane: tuple[SiteDataPlane, dict[str, VariantMeta]]) -> None:
    dp, _ = plane
    await register_pipeline(store, "digits-seq", Graph("sequence", (("digits-prep", None),
                                                                     ("digit-classification", {"x": "prev.y"}))))
    await eventually(_now(lambda: "digits-seq" in dp.view.pipelines), 10, "the view follows pipelines/")
    await Catalog(store).remove_variant("digit-classification", "head-digits.onnx.fp32")
    await eventually(_now(lambda: not dp.view.variants.get("digit-classification")), 10, "the stage's variant gone")
    x = np.ascontiguousarray(digits_split().x_val[:2], dtype=np.float32)
    with pytest.raises(MeshError, match=r"pipeline digits-seq stage 2 \(digit-classification\) failed") as err:
        await dp.infer(InferRequest.entering("digits-seq", {"x": x}, SLO(latency_ms=5000.0)))
    assert err.value.details["stage"] == 2 and err.value.details["stage_task"] == "digit-classification"
    # a tenant's private pipeline is unknown to another tenant
    await store.put(pipeline_key("digits-seq"), {**(await store.get(pipeline_key("digits-seq"))).value,  # type: ignore[union-attr]
                                                "owner": "acme"})
    await eventually(_now(lambda: dp.view.pipelines["digits-seq"].owner == "acme"), 10, "the owner changed")
    assert not dp.visible("digits-seq", "globex") and dp.visible("digits-seq", "acme")
    with pytest.raises(UnknownTask):
        await dp.infer(InferRequest.entering("digits-seq", {"x": x}, SLO(latency_ms=5000.0), tenant="public"))
