"""Batch poisoning (issue 29): a tenant whose inputs disagree on their rows is refused at the door, and the other
tenants' requests batched with it are served.

A real two-input ONNX model (token features and their mask, as the text family's ``input_ids`` and
``attention_mask``) on ONNX Runtime, behind the site's batcher, with the door's one input check in front of it as
``SiteDataPlane.infer`` makes it (``check_inputs``, then ``Batcher.submit`` with the caller's tenant). Before the
check compared the inputs' first dimensions, the odd request went into the merged batch, whose inputs then had
different row counts, and ONNX Runtime failed the whole batch: every tenant in it got the error."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edge_agent.batching import Batcher
from mesh.errors import BadTensor
from mesh.types import TaskSignature, TensorSpec, check_inputs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

WIDTH, OUT = 8, 4
SIG = TaskSignature("masked-features", (TensorSpec("x", "float32", (-1, WIDTH)),
                                        TensorSpec("mask", "float32", (-1, WIDTH))),
                    (TensorSpec("y", "float32", (-1, OUT)),))


def _masked_linear(path: Path) -> Path:
    """y = (x * mask) @ w: both inputs batched along their first dimension."""
    w = np.arange(WIDTH * OUT, dtype=np.float32).reshape(WIDTH, OUT) / 10.0
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "mask"], ["masked"]), helper.make_node("MatMul", ["masked", "w"], ["y"])],
        "masked_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH]),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", OUT])],
        [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.flatten())])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


async def test_a_tenants_odd_rows_do_not_fail_the_others_in_its_batch(tmp_path: Path) -> None:
    sess = ort.InferenceSession(str(_masked_linear(tmp_path / "masked.onnx")), providers=["CPUExecutionProvider"])

    def infer(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": sess.run(None, inputs)[0]}

    rng = np.random.default_rng(29)

    def rows(n: int) -> np.ndarray:
        return rng.random((n, WIDTH), dtype=np.float32)

    with ThreadPoolExecutor(1) as pool:
        # a window long enough that every request below lands in one batch; no inline runs (each one queues)
        b = Batcher("masked.onnx.fp32", infer, executor=pool, compute_ms=lambda n: 0.05 + 0.01 * n,
                    max_batch=32, max_window_ms=200, inline_max_ms=0.0)
        b.start()

        async def door(tenant: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            checked = check_inputs(SIG.inputs, inputs)  # the data plane's one input check
            return (await b.submit(checked, time.monotonic() + 10.0, lane="masked.onnx.fp32",
                                   tenant=tenant)).outputs

        try:
            good = [(tenant, {"x": rows(n), "mask": (rows(n) > 0.5).astype(np.float32)})
                    for tenant, n in [("acme", 1), ("globex", 2), ("acme", 1), ("initech", 3)]]
            hostile = ("mallory", {"x": rows(2), "mask": np.ones((3, WIDTH), np.float32)})
            calls = [door(t, x) for t, x in good[:2]] + [door(*hostile)] + [door(t, x) for t, x in good[2:]]
            results = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await b.stop()
    refused = results.pop(2)
    for (tenant, inputs), got in zip(good, results, strict=True):
        assert not isinstance(got, BaseException), f"{tenant}'s request failed with the hostile one: {got!r}"
        np.testing.assert_allclose(got["y"], sess.run(None, inputs)[0], rtol=1e-5)
    assert isinstance(refused, BadTensor) and "disagree on the batch" in refused.message, refused
    # the good requests really were batched together, across tenants
    assert any(len(set(m)) > 1 for m in b.membership), list(b.membership)
