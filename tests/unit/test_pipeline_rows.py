"""A pipeline's validation rows (:func:`variant_store.pipeline_measure.load_rows`): a file that is not an ``.npz``,
inputs missing or unknown, labels missing, not integers or not one per row, rows the pipeline's door would refuse,
each refused with ``PipelineRefused`` (reason ``validation``) saying why; good rows cast and bounded. Also the
pure parts of the measurement: which variant runs a stage, and rows routed through a Switch as the door routes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mesh.errors import MeshError, PipelineRefused
from mesh.types import TaskSignature, TensorSpec
from variant_store.meta import VariantMeta
from variant_store.pipeline_measure import choose_variant, load_rows, run_graph
from variant_store.pipeline_meta import PipelineMeta, Stage

pytestmark = pytest.mark.unit

SIG = TaskSignature("pipe", (TensorSpec("x", "float32", (-1, 4)), TensorSpec("k", "int64", (-1,))),
                    (TensorSpec("logits", "float32", (-1, 3)),))
X = np.zeros((5, 4), dtype=np.float32)
K = np.arange(5, dtype=np.int64)
Y = np.array([0, 1, 2, 1, 0])


def _npz(tmp: Path, **arrays: Any) -> Path:
    path = tmp / "val.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(("arrays", "words"), [
    ({"x": X, "k": K}, "no 'labels' array"),
    ({"x": X, "labels": Y}, "lack ['k']"),
    ({"x": X, "k": K, "extra": K, "labels": Y}, "hold unknown ['extra']"),
    ({"x": X, "k": K, "labels": Y[:4]}, "one label per row"),
    ({"x": X[:4], "k": K[:4], "labels": Y}, "one label per row"),
    ({"x": X, "k": K, "labels": Y.astype(np.float32)}, "one integer class per row"),
    ({"x": X, "k": K, "labels": Y.reshape(1, 5)}, "one integer class per row"),
    ({"x": np.zeros((5, 3), dtype=np.float32), "k": K, "labels": Y}, "input 'x': expected shape"),
    ({"x": X.astype(np.int64), "k": K, "labels": Y}, "input 'x': expected dtype float32"),
])
def test_bad_rows_are_refused_saying_why(tmp_path: Path, arrays: dict[str, np.ndarray], words: str) -> None:
    with pytest.raises(PipelineRefused) as exc:
        load_rows(_npz(tmp_path, **arrays), SIG)
    assert exc.value.reason == "validation" and words in exc.value.message, exc.value.message


@pytest.mark.parametrize("content", [b"kind: sequence\n", b"", b"PK\x03\x04 truncated"])
def test_a_file_that_is_not_an_npz_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "val.npz"
    path.write_bytes(content)
    with pytest.raises(PipelineRefused) as exc:
        load_rows(path, SIG)
    assert exc.value.reason == "validation" and "not an .npz" in exc.value.message


def test_a_single_array_or_a_missing_file_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", X)
    for path in (tmp_path / "x.npy", tmp_path / "absent.npz"):
        with pytest.raises(PipelineRefused, match=r"not an \.npz"):
            load_rows(path, SIG)


def test_good_rows_are_cast_and_bounded(tmp_path: Path) -> None:
    rows = load_rows(_npz(tmp_path, x=X.astype(np.float64), k=K.astype(np.int32), labels=Y.reshape(5, 1)), SIG,
                     max_rows=3)
    assert len(rows) == 3 and rows.labels.tolist() == [0, 1, 2] and rows.labels.dtype == np.int64
    assert rows.inputs["x"].dtype == np.float32 and rows.inputs["k"].dtype == np.int64
    assert rows.inputs["x"].shape == (3, 4)


def _variant(vid: str, accuracy: float, *, owner: str = "public", share: float = 1.0, fmt: str = "onnx",
             size: int = 10) -> VariantMeta:
    return VariantMeta(task="t", family=vid, variant_id=vid, format=fmt, precision="fp32",  # type: ignore[arg-type]
                       runtime="onnxruntime", blob_digest="0" * 64, size_bytes=size, accuracy=accuracy,
                       owner=owner, share=share)


def test_the_stage_runs_as_the_most_accurate_variant_the_owner_may_use_here() -> None:
    vs = [_variant("small", 0.90), _variant("acme", 0.99, owner="acme"), _variant("idle", 0.98, share=0.0),
          _variant("trt", 0.97, fmt="tensorrt"), _variant("big", 0.95, size=100), _variant("tie", 0.95, size=50)]
    chosen = choose_variant(vs, "public")
    assert chosen is not None and chosen.variant_id == "tie"
    chosen = choose_variant(vs, "acme")
    assert chosen is not None and chosen.variant_id == "acme"
    assert choose_variant([_variant("other", 0.9, owner="globex")], "acme") is None


def _switch(table: tuple[tuple[int, str], ...]) -> PipelineMeta:
    sig = TaskSignature("sw", (TensorSpec("x", "float32", (-1, 1)),), (TensorSpec("out", "float32", (-1, 2)),))
    branches = tuple(dict.fromkeys(t for _, t in table))
    return PipelineMeta(task="sw", kind="switch", stages=(Stage("sel", (("x", "input.x"),)),), signature=sig,
                        select="logits", table=table,
                        branches=tuple(Stage(b, (("x", "input.x"), ("s", "prev.logits"))) for b in branches))


def test_switch_rows_go_to_their_branch_and_come_back_in_order() -> None:
    x = np.array([[0.0], [1.0], [1.0], [0.0], [1.0]], dtype=np.float32)
    seen: dict[str, int] = {}

    def run(task: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if task == "sel":  # class 1 for x == 1
            return {"logits": np.concatenate([1 - inputs["x"], inputs["x"]], axis=1)}
        seen[task] = len(inputs["x"])
        assert inputs["s"].shape == (len(inputs["x"]), 2)  # fed the selector's rows, by name
        mark = 10.0 if task == "a" else 20.0
        return {"out": np.concatenate([inputs["x"] + mark, inputs["x"]], axis=1)}

    out = run_graph(_switch(((0, "a"), (1, "b"))), {"x": x}, run)
    assert seen == {"a": 2, "b": 3}
    assert out["out"][:, 0].tolist() == [10.0, 21.0, 21.0, 10.0, 21.0]
    with pytest.raises(MeshError, match="does not map"):
        run_graph(_switch(((0, "a"),)), {"x": x}, run)
