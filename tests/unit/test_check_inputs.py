"""The one input check (``mesh.types.check_inputs``), made at the data plane's door."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mesh.errors import BadTensor
from mesh.types import TaskSignature, TensorSpec, check_inputs

pytestmark = pytest.mark.unit

SIG = TaskSignature("digit-classification", (TensorSpec("x", "float32", (-1, 64)),),
                    (TensorSpec("logits", "float32", (-1, 10)),))
TWO = (TensorSpec("a", "int64", (-1, 3)), TensorSpec("b", "float32", (2,)))


def test_valid_inputs_pass_as_they_are() -> None:
    x = np.zeros((3, 64), np.float32)
    assert check_inputs(SIG.inputs, {"x": x})["x"] is x  # no copy on the common path
    a, b = np.ones((1, 3), np.int64), np.ones(2, np.float32)
    out = check_inputs(TWO, {"b": b, "a": a})
    assert list(out) == ["a", "b"] and out["a"] is a and out["b"] is b  # in spec order


def test_non_contiguous_inputs_come_back_contiguous() -> None:
    x = np.zeros((64, 3), np.float32).T
    out = check_inputs(SIG.inputs, {"x": x})["x"]
    assert out.flags.c_contiguous and np.array_equal(out, x)


@pytest.mark.parametrize(("inputs", "fragment"), [
    ({}, "missing input tensor"),
    ({"x": np.zeros((3, 64), np.float32), "y": np.zeros(1)}, "unknown input tensor"),
    ({"x": np.zeros((3, 64), np.float64)}, "'x': expected dtype float32, got float64"),
    ({"x": np.zeros((3, 64), ">f4")}, "'x': expected dtype float32"),
    ({"x": np.zeros((3, 63), np.float32)}, r"'x': expected shape \(N, 64\), got \(3, 63\)"),
    ({"x": np.zeros(64, np.float32)}, "expected shape"),
    ({"x": np.zeros((0, 64), np.float32)}, "expected shape"),  # a batch of no rows
    ({"x": [[0.0] * 64]}, "expected a numpy array"),
])
def test_bad_inputs_are_bad_tensor_naming_it(inputs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(BadTensor, match=fragment) as info:
        check_inputs(SIG.inputs, inputs)
    assert info.value.code == "bad_tensor" and info.value.http_status == 400


# A multi-input task (token ids and their mask, as the text family's): the batcher concatenates every input of
# the requests it merges, so inputs that disagree on their rows would fail every request in the batch (issue 29).
TEXT = (TensorSpec("input_ids", "int64", (-1, 8)), TensorSpec("attention_mask", "int64", (-1, 8)))


@pytest.mark.parametrize("contiguous", [True, False])  # the fast path, and the checked path behind it
def test_inputs_that_disagree_on_the_batch_are_bad_tensor(contiguous: bool) -> None:
    ids, mask = np.ones((2, 8), np.int64), np.ones((3, 8), np.int64)
    if not contiguous:
        mask = np.ones((8, 3), np.int64).T
    with pytest.raises(BadTensor, match=r"disagree on the batch \(first\) dimension: "
                                        r"\{'input_ids': 2, 'attention_mask': 3\}") as info:
        check_inputs(TEXT, {"input_ids": ids, "attention_mask": mask})
    assert info.value.http_status == 400 and info.value.details["rows"] == {"input_ids": 2, "attention_mask": 3}


def test_inputs_that_agree_on_the_batch_pass_and_fixed_inputs_are_not_rows() -> None:
    ids, mask = np.ones((3, 8), np.int64), np.zeros((3, 8), np.int64)
    out = check_inputs(TEXT, {"input_ids": ids, "attention_mask": mask})
    assert out["input_ids"] is ids and out["attention_mask"] is mask
    # an input whose spec fixes its first dimension is not batched (TWO's 'b'): it need not match the rows
    assert check_inputs(TWO, {"a": np.ones((4, 3), np.int64), "b": np.ones(2, np.float32)})["b"].shape == (2,)
