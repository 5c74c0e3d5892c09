"""``tiermesh variants ...`` end to end on real etcd, real ONNX Runtime and a really trained model:
register, build (generate + measure + profile), list, show, profile; rebuilds are deterministic."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from mesh.etcd.store import Store
from tests.helpers_models import digits_split, trained_mlp_onnx
from tiermesh.cli.main import EXIT_OK, main
from variant_store.blobs import BlobStore
from variant_store.hardware import local_hardware_class

pytestmark = pytest.mark.integration

TASK = "digit-classification"
KINDS = ["onnx.fp32", "onnx.int8-dynamic", "onnx.fp16"]
CALIB = 100


@pytest.fixture
def common(etcd_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """--etcd/--prefix/--home for one test: a fresh key prefix on the session etcd, removed after."""
    monkeypatch.setattr("tiermesh.cli.main.configure", lambda *a, **k: None)  # keep pytest's log capture
    prefix = f"/t-cli-{uuid.uuid4().hex[:10]}/"
    yield ["--etcd", etcd_server.url, "--prefix", prefix, "--home", str(tmp_path / "home")]

    async def wipe() -> None:
        async with await Store.connect(etcd_server.url, prefix) as s:
            await s.delete_prefix("")

    asyncio.run(wipe())


@pytest.fixture
def model_files(tmp_path: Path) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    """A real MLP trained on digits and a validation npz (first CALIB rows calibrate, rest score)."""
    split = digits_split()
    onnx_path = trained_mlp_onnx(tmp_path / "mlp.onnx")
    npz = tmp_path / "val.npz"
    np.savez(npz, x=split.x_val, y=split.y_val, calib_count=np.asarray(CALIB))
    return onnx_path, npz, split.x_val[CALIB:], split.y_val[CALIB:]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _list_json(capsys: pytest.CaptureFixture[str], common: list[str]) -> dict[str, dict[str, Any]]:
    rc, out, _ = _cli(capsys, "variants", "list", "--task", TASK, "--json", *common)
    assert rc == EXIT_OK
    return {row["id"]: row for row in json.loads(out)}


def test_register_build_list_show_profile(capsys: pytest.CaptureFixture[str], common: list[str],
                                          model_files: tuple[Path, Path, np.ndarray, np.ndarray]) -> None:
    onnx_path, npz, x_hold, y_hold = model_files
    rc, out, err = _cli(capsys, "variants", "register", "--task", TASK, "--family", "mlp",
                        "--model", str(onnx_path), "--validation", str(npz), *common)
    assert rc == EXIT_OK, err
    assert "registered digit-classification/mlp" in out

    build = ["variants", "build", "--task", TASK, "--kinds", *KINDS, "--repeats", "3", "--json"]
    rc, out, err = _cli(capsys, *build, *common)
    assert rc == EXIT_OK, err
    report = json.loads(out)[0]
    assert sorted(b["variant"] for b in report["built"]) == sorted(f"mlp.{k}" for k in KINDS)

    rows = _list_json(capsys, common)
    assert sorted(rows) == sorted(f"mlp.{k}" for k in KINDS)
    hw = local_hardware_class()
    # the FP32 variant's accuracy must be what the model really scores on the held-out rows
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    expected = float(np.mean(sess.run(None, {"x": x_hold})[0].argmax(axis=1) == y_hold))
    assert rows["mlp.onnx.fp32"]["accuracy"] == pytest.approx(expected, abs=1e-9)
    assert expected > 0.9
    for vid, row in rows.items():
        assert abs(row["accuracy"] - expected) < 0.03, vid  # quantized, but still the same model
        prof = row["profiles"][hw]
        assert set(prof["latency"]) == {"1", "8", "32"}
        assert 0 < prof["latency"]["1"]["p50_ms"] <= prof["latency"]["1"]["p99_ms"]
        assert prof["load_ms"] > 0 and prof["providers"]
        assert row["size_bytes"] > 0
    assert rows["mlp.onnx.int8-dynamic"]["precision"] == "int8"
    assert rows["mlp.onnx.int8-dynamic"]["size_bytes"] < rows["mlp.onnx.fp32"]["size_bytes"]
    assert rows["mlp.onnx.int8-dynamic"]["parent"] == "mlp.onnx.fp32"

    blobs = BlobStore(Path(common[-1]) / "blobs")
    for row in rows.values():
        blobs.verify(row["digest"])  # the bytes the catalog names are really there

    # rebuilding gives the same bytes and the same accuracy
    rc, _, err = _cli(capsys, *build, *common)
    assert rc == EXIT_OK, err
    again = _list_json(capsys, common)
    for vid, row in rows.items():
        assert again[vid]["digest"] == row["digest"], vid
        assert abs(again[vid]["accuracy"] - row["accuracy"]) <= 0.005

    rc, out, _ = _cli(capsys, "variants", "show", "--task", TASK, "--variant", "mlp.onnx.fp16", *common)
    assert rc == EXIT_OK
    shown = json.loads(out)
    assert shown["variant_id"] == "mlp.onnx.fp16" and shown["blob_digest"] == rows["mlp.onnx.fp16"]["digest"]

    before = rows["mlp.onnx.fp32"]["profiles"][hw]["measured_at"]
    rc, _, err = _cli(capsys, "variants", "profile", "--task", TASK, "--variant", "mlp.onnx.fp32",
                      "--repeats", "2", *common)
    assert rc == EXIT_OK, err
    after = _list_json(capsys, common)["mlp.onnx.fp32"]
    assert after["profiles"][hw]["measured_at"] > before
    assert after["accuracy"] == pytest.approx(expected, abs=1e-9)

    rc, out, _ = _cli(capsys, "variants", "list", *common)  # the human table
    assert rc == EXIT_OK and "mlp.onnx.int8-dynamic" in out


def test_bad_inputs_fail_with_a_message(capsys: pytest.CaptureFixture[str], common: list[str],
                                        model_files: tuple[Path, Path, np.ndarray, np.ndarray],
                                        tmp_path: Path) -> None:
    onnx_path, npz, _, _ = model_files
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    rc, _, err = _cli(capsys, "variants", "register", "--task", TASK, "--family", "x", "--model", str(junk),
                      "--validation", str(npz), *common)
    assert rc != EXIT_OK and "not a readable ONNX model" in err
    rc, _, err = _cli(capsys, "variants", "show", "--task", TASK, "--variant", "nope", *common)
    assert rc != EXIT_OK and "nope" in err
    rc, _, err = _cli(capsys, "variants", "build", "--task", "no-such-task", *common)
    assert rc != EXIT_OK and "no registered models" in err
    # a model whose inputs differ from the task's is refused: callers never name the model
    rc, _, err = _cli(capsys, "variants", "register", "--task", TASK, "--family", "mlp", "--model",
                      str(onnx_path), "--validation", str(npz), *common)
    assert rc == EXIT_OK, err
    other = tmp_path / "other.onnx"
    _write_identity_model(other, features=16)
    rc, _, err = _cli(capsys, "variants", "register", "--task", TASK, "--family", "odd", "--model", str(other),
                      "--validation", str(npz), *common)
    assert rc != EXIT_OK and "differ from task" in err


def _write_identity_model(path: Path, features: int) -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["logits"])], "id",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", features])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())


@pytest.mark.slow
def test_build_digits_family(capsys: pytest.CaptureFixture[str], common: list[str]) -> None:
    """The committed digits family: classifiers, the shared backbone and the tenants' heads."""
    from variant_store.families.datasets import DIGITS_DIR

    if not (DIGITS_DIR / "manifest.json").is_file():
        pytest.skip("variant_store/models/digits is not committed in this checkout")
    manifest = json.loads((DIGITS_DIR / "manifest.json").read_text())
    rc, _, err = _cli(capsys, "variants", "build-digits", "--repeats", "2", *common)
    assert rc == EXIT_OK, err
    rc, out, _ = _cli(capsys, "variants", "list", "--json", *common)
    rows = {(r["task"], r["id"]): r for r in json.loads(out)}
    by_file = {e["file"]: e for e in manifest["models"]}
    backbone = next(e for e in manifest["models"] if e["role"] == "backbone")
    for e in manifest["models"]:
        row = rows[(e["task"], f"{e['family']}.onnx.fp32")]
        assert row["digest"] == e["sha256"] and row["owner"] == e["owner"]
        if e["accuracy"] is not None:  # measured here on the same holdout rows as the trainer did
            assert row["accuracy"] == pytest.approx(e["accuracy"], abs=0.005), e["file"]
        if e["role"] == "head":
            assert row["shared_base_digest"] == by_file[e["backbone"]]["sha256"] == backbone["sha256"]
    assert rows[(backbone["task"], "backbone.onnx.fp32")]["accuracy"] > 0.999  # fidelity to itself
