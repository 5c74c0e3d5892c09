"""``tiermesh variants cascade / cascades / remove --cascade`` end to end: real etcd, the committed digits family
built with real ONNX Runtime, the CLI's exit codes and output."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mesh.etcd.store import Store
from tiermesh.cli.main import EXIT_BAD_INPUT, EXIT_OK, main
from variant_store.blobs import BlobStore
from variant_store.build import ensure_digits_family
from variant_store.catalog import Catalog

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TASK = "digit-classification"
SMALL, LARGE = "mlp-tiny.onnx.int8-static", "cnn-large.onnx.fp32"


@pytest.fixture
def common(etcd_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """--etcd/--prefix/--home with the digits family (two kinds) built there; the prefix is removed after."""
    monkeypatch.setattr("tiermesh.cli.main.configure", lambda *a, **k: None)  # keep pytest's log capture
    prefix = f"/t-casc-{uuid.uuid4().hex[:10]}/"
    home = tmp_path / "home"

    async def build() -> None:
        async with await Store.connect(etcd_server.url, prefix) as s:
            await ensure_digits_family(Catalog(s), BlobStore(home / "blobs"), repeats=2, progress=False,
                                       kinds=["onnx.fp32", "onnx.int8-static"])

    async def wipe() -> None:
        async with await Store.connect(etcd_server.url, prefix) as s:
            await s.delete_prefix("")

    asyncio.run(build())
    try:
        yield ["--etcd", etcd_server.url, "--prefix", prefix, "--home", str(home)]
    finally:
        asyncio.run(wipe())


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cascade_register_list_remove(capsys: pytest.CaptureFixture[str], common: list[str]) -> None:
    rc, out, err = _cli(capsys, "variants", "cascade", "--task", TASK, "--stages", f"{SMALL},{LARGE}",
                        "--id", "edge-core", *common)
    assert rc == EXIT_OK, err
    assert "stage 1/2" in err and "edge-core" in out and "->" in out  # progress, then the result table

    rc, out, _ = _cli(capsys, "variants", "cascades", "--task", TASK, "--json", *common)
    assert rc == EXIT_OK
    rows = {r["id"]: r for r in json.loads(out)}
    assert "edge-core" in rows and len(rows) == 2  # and the family's built-in one
    row = rows["edge-core"]
    assert row["stages"] == [SMALL, LARGE] and row["rule"] == "max_softmax"
    assert 0.95 < row["accuracy"] <= 1.0 and 0.0 < row["escalation"][0] < 0.6
    assert row["calibration_rows"] + row["heldout_rows"] == 519

    rc, out, err = _cli(capsys, "variants", "cascade", "--task", TASK, "--stages", f"{SMALL},{LARGE}",
                        "--rule", "margin", "--target-accuracy", "1.0", "--id", "perfect", *common)
    assert rc == EXIT_BAD_INPUT and "no threshold reaches" in err
    rc, _, err = _cli(capsys, "variants", "cascade", "--task", TASK, "--stages", f"{SMALL},nope.onnx.fp32",
                      *common)
    assert rc == EXIT_BAD_INPUT and "not variants of task" in err
    rc, _, err = _cli(capsys, "variants", "cascade", "--task", "digit-parity", "--stages",
                      f"head-parity.onnx.fp32,{LARGE}", *common)
    assert rc == EXIT_BAD_INPUT

    rc, out, _ = _cli(capsys, "variants", "cascades", *common)
    assert rc == EXIT_OK and "edge-core" in out and "perfect" not in out

    rc, out, err = _cli(capsys, "variants", "remove", "--task", TASK, "--cascade", "edge-core", "--yes", *common)
    assert rc == EXIT_OK, err
    assert "1 cascades" in out
    rc, _, err = _cli(capsys, "variants", "remove", "--task", TASK, "--cascade", "edge-core", "--yes", *common)
    assert rc == EXIT_BAD_INPUT and "no cascade" in err
    rc, out, _ = _cli(capsys, "variants", "cascades", "--task", TASK, "--json", *common)
    assert "edge-core" not in {r["id"] for r in json.loads(out)}
