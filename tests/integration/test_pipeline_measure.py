"""Measuring a registered pipeline end to end (issue 33, item 2; :mod:`variant_store.pipeline_measure`) with a real
etcd, a real blob store and real ONNX Runtime sessions: a Switch and a Sequence over digits tasks measured on the
digits validation rows and checked against the same graph computed here with onnxruntime directly, a Switch whose
figure falls when a branch is a deliberately bad head, the owner's private variant used only for its own pipeline,
and the CLI measuring, registering and refusing bad validation files.

The models: the committed digits backbone with its digit and parity heads (``tests.helpers_backbone``), the standalone
``mlp-wide`` and ``mlp-tiny`` digits models, a one-node ``digits-prep`` (x -> y = 2 x) and a bad head on the
backbone that answers class 0 for every row, both written here."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml

from mesh.errors import PipelineRefused
from mesh.etcd.keys import pipeline_key
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.types import TaskSignature, TensorSpec
from tests.helpers_backbone import DIGITS, head_meta, model_meta
from tests.helpers_models import digits_split
from tiermesh.cli.main import EXIT_BAD_INPUT, EXIT_OK, main
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.meta import VariantMeta
from variant_store.pipeline_catalog import Graph, get_pipeline, register_pipeline
from variant_store.pipeline_measure import check_rows, measure_pipeline, plan_pipeline

pytestmark = pytest.mark.integration

X = (TensorSpec("x", "float32", (-1, 64)),)
GOOD = Graph("switch", (("digit-parity", None),), "logits", ((0, "digit-classification"), (1, "digits-wide")),
             (("digit-classification", None), ("digits-wide", None)))
BAD = Graph("switch", (("digit-parity", None),), "logits", ((0, "digit-classification"), (1, "digits-bad")),
            (("digit-classification", None), ("digits-bad", None)))
SEQUENCE = {"kind": "sequence", "stages": ["digits-prep", {"task": "digit-classification", "feeds": {"x": "prev.y"}}]}


def _onnx(dest: Path, nodes: list[object], inp: str, out: str, inits: list[object]) -> Path:
    import onnx
    from onnx import TensorProto, helper

    width = 10 if out == "logits" else 64
    graph = helper.make_graph(nodes, dest.stem, [helper.make_tensor_value_info(inp, TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["batch", width])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(dest))
    return dest


def _prep(dest: Path) -> Path:
    from onnx import helper, numpy_helper

    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    return _onnx(dest, [helper.make_node("Mul", ["x", "two"], ["y"])], "x", "y", [two])


def _bad_head(dest: Path) -> Path:
    """A head on the backbone's features that answers class 0 whatever the row."""
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.zeros((64, 10), dtype=np.float32), "w")
    b = numpy_helper.from_array(np.eye(10, dtype=np.float32)[0] * 5.0, "b")
    nodes = [helper.make_node("MatMul", ["features", "w"], ["z"]), helper.make_node("Add", ["z", "b"], ["logits"])]
    return _onnx(dest, nodes, "features", "logits", [w, b])


def _variant(task: str, variant_id: str, path: Path, digest: str, accuracy: float, *, metric: str = "top1",
             out: str = "logits", base: str | None = None, owner: str = "public") -> VariantMeta:
    width = 10 if out == "logits" else 64
    return VariantMeta(task=task, family=variant_id.split(".")[0], variant_id=variant_id, format="onnx",
                       precision="fp32", runtime="onnxruntime", blob_digest=digest, size_bytes=path.stat().st_size,
                       accuracy=accuracy, metric=metric, inputs=[{"name": "x", "dtype": "float32", "shape": [-1, 64]}],
                       outputs=[{"name": out, "dtype": "float32", "shape": [-1, width]}], shared_base_digest=base,
                       owner=owner)


async def _catalog(store: Store, blobs: BlobStore, tmp: Path) -> dict[str, Path]:
    """Every digits file put in ``blobs`` and catalogued; the files by short name (for the direct computation)."""
    files = {f.stem: f for f in DIGITS.glob("*.onnx")}
    files["prep"] = _prep(tmp / "prep.onnx")
    files["bad"] = _bad_head(tmp / "bad.onnx")
    digest = {name: await asyncio.to_thread(blobs.put_file, f) for name, f in files.items()}
    base = digest["backbone"]
    metas = [
        dataclasses.replace(head_meta("head-parity.onnx.fp32", "head-parity.onnx", task="digit-parity"), accuracy=0.97),
        dataclasses.replace(head_meta("head-digits.onnx.fp32"), accuracy=0.95),
        dataclasses.replace(model_meta("mlp-tiny.onnx.fp32", "mlp-tiny.onnx"), accuracy=0.80),  # less accurate
        # more accurate on paper, but acme's: only acme's pipelines may be measured (and served) with it
        _variant("digit-classification", "acme-bad.onnx.fp32", files["bad"], digest["bad"], 0.99, base=base,
                 owner="acme"),
        dataclasses.replace(model_meta("mlp-wide.onnx.fp32", "mlp-wide.onnx"), task="digits-wide", accuracy=0.96),
        _variant("digits-bad", "bad.onnx.fp32", files["bad"], digest["bad"], 0.10, base=base),
        _variant("digits-prep", "prep.onnx.fp32", files["prep"], digest["prep"], 1.0, metric="cosine", out="y"),
    ]
    catalog = Catalog(store)
    for m in metas:
        assert blobs.has(m.blob_digest)
        outs = tuple(TensorSpec(o["name"], o["dtype"], tuple(o["shape"])) for o in m.outputs)
        await catalog.put_task(TaskSignature(m.task, X, outs, m.metric))
        await catalog.put_variant(m)
    return files


def _ort(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {sess.get_inputs()[0].name: x})[0])


def _switch_direct(files: dict[str, Path], x: np.ndarray, y: np.ndarray, odd: str) -> float:
    """The Switch computed here: parity of the backbone's features picks head-digits (even) or ``odd``."""
    feats = _ort(files["backbone"], x)
    even = _ort(files["head-parity"], feats).argmax(1) == 0
    odd_out = _ort(files[odd], feats if odd == "bad" else x)
    answer = np.where(even[:, None], _ort(files["head-digits"], feats), odd_out).argmax(1)
    assert 0.2 < even.mean() < 0.8  # both branches answer rows
    return float(np.mean(answer == y))


@pytest.fixture
def rows() -> tuple[np.ndarray, np.ndarray]:
    split = digits_split()
    return split.x_val, split.y_val


async def test_switch_measured_as_computed_directly_and_a_bad_branch_shows(
        store: Store, tmp_path: Path, rows: tuple[np.ndarray, np.ndarray]) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    files = await _catalog(store, blobs, tmp_path)
    catalog = Catalog(store)
    x, y = rows

    good = await plan_pipeline(store, "digits-switch", GOOD)
    m = await measure_pipeline(catalog, blobs, good, check_rows(good.signature, {"x": x, "labels": y}),
                               batch_rows=128)  # batches that split the rows unevenly between the branches
    direct = _switch_direct(files, x, y, "mlp-wide")
    assert m.rows == len(y) == 450
    assert abs(m.accuracy - direct) < 1e-12 and direct > 0.8
    # each stage by its most accurate public variant, whose accuracy is the floor its stage queries will ask
    assert m.variants == {"digit-parity": "head-parity.onnx.fp32", "digit-classification": "head-digits.onnx.fp32",
                          "digits-wide": "mlp-wide.onnx.fp32"}
    assert m.stage_accuracy == {"digit-parity": 0.97, "digit-classification": 0.95, "digits-wide": 0.96}

    meta = await register_pipeline(store, "digits-switch", GOOD, accuracy=m.accuracy, heldout_rows=m.rows,
                                   stage_accuracy=m.stage_accuracy)
    assert (await get_pipeline(store, "digits-switch")) == meta and meta.floor("digits-wide") == 0.96

    # the same Switch with a deliberately bad head for odd rows: the figure falls, as computed directly
    bad = await plan_pipeline(store, "digits-bad-switch", BAD)
    mb = await measure_pipeline(catalog, blobs, bad, check_rows(bad.signature, {"x": x, "labels": y}))
    direct_bad = _switch_direct(files, x, y, "bad")
    assert abs(mb.accuracy - direct_bad) < 1e-12
    assert mb.accuracy < m.accuracy - 0.3

    # acme's pipeline may use acme's private variant (the most accurate on paper, a bad head in fact): used, and
    # its accuracy is the floor; a public pipeline never saw it
    acme = await plan_pipeline(store, "acme-switch", GOOD, owner="acme")
    ma = await measure_pipeline(catalog, blobs, acme, check_rows(acme.signature, {"x": x, "labels": y}))
    assert ma.variants["digit-classification"] == "acme-bad.onnx.fp32"
    assert ma.stage_accuracy["digit-classification"] == 0.99
    assert ma.accuracy < m.accuracy - 0.3

    # a pipeline of pipelines is refused (its own floors, not the variants run here, would decide how it serves)
    nested = await plan_pipeline(store, "nested", Graph("sequence", (("digits-switch", None),)))
    with pytest.raises(PipelineRefused) as exc:
        await measure_pipeline(catalog, blobs, nested, check_rows(nested.signature, {"x": x, "labels": y}))
    assert exc.value.reason == "nested"


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = await asyncio.to_thread(main, list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


async def test_cli_measures_a_sequence_then_registers_it(store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         rows: tuple[np.ndarray, np.ndarray]) -> None:
    home = tmp_path / "home"
    files = await _catalog(store, BlobStore(home / "blobs"), tmp_path)
    x, y = rows
    common = ["--etcd", etcd_server.url, "--prefix", store.prefix, "--home", str(home)]
    graph = tmp_path / "seq.yaml"
    graph.write_text(yaml.safe_dump(SEQUENCE))
    val = tmp_path / "val.npz"
    np.savez(val, x=x.astype(np.float64), labels=y)  # float64 rows: cast to the input's float32

    rc, out, err = await _cli(capsys, "variants", "pipeline", "--task", "digits-seq", "--graph", str(graph),
                              "--validation", str(val), *common)
    assert rc == EXIT_OK, err
    assert "registered as pipelines/digits-seq" in out and "on 450 labelled rows" in err
    entry = (await store.get(pipeline_key("digits-seq"))).value  # type: ignore[union-attr]
    # the head behind its backbone, fed 2 x by name (x <- prev.y)
    direct = float(np.mean(_ort(files["head-digits"], _ort(files["backbone"], 2 * x)).argmax(1) == y))
    assert entry["accuracy"] == round(direct, 6) and entry["heldout_rows"] == 450
    assert entry["stage_accuracy"] == {"digits-prep": 1.0, "digit-classification": 0.95}

    # bad validation files: exit 2 with the reason, nothing written
    shutil.copyfile(graph, tmp_path / "not.npz")
    np.savez(tmp_path / "short.npz", x=x, labels=y[:-1])
    np.savez(tmp_path / "misnamed.npz", pixels=x, labels=y)
    for name, words in (("not.npz", "not an .npz"), ("short.npz", "one label per row"),
                        ("misnamed.npz", "lack ['x']")):
        rc, _, err = await _cli(capsys, "variants", "pipeline", "--task", "digits-seq2", "--graph", str(graph),
                                "--validation", str(tmp_path / name), *common)
        assert rc == EXIT_BAD_INPUT and words in err, err
        assert await store.get(pipeline_key("digits-seq2")) is None
    # without --validation: registered unmeasured, as before
    rc, _, err = await _cli(capsys, "variants", "pipeline", "--task", "digits-seq2", "--graph", str(graph), *common)
    assert rc == EXIT_OK, err
    assert (await get_pipeline(store, "digits-seq2")).accuracy is None
