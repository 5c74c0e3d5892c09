"""The contention diagnostic (``bench.backbone_contention``) times real ONNX Runtime runs, with and without a busy
Python thread beside them; here on the committed digits backbone, briefly."""

from __future__ import annotations

import pytest

import bench.backbone_contention as contention
from tests.helpers_backbone import DIGITS


@pytest.mark.parametrize(("threads", "at_once"), [(2, 1), (1, 2)])
def test_a_cell_times_batches_back_to_back_with_and_without_busy_python(monkeypatch: pytest.MonkeyPatch,
                                                                       threads: int, at_once: int) -> None:
    monkeypatch.setattr(contention, "SECONDS", 0.2)
    for busy in (0.0, contention.BUSY):
        cell = contention._cell(DIGITS / "backbone.onnx", threads, at_once, 32, busy)
        assert cell["rows_per_s"] > 32 / contention.SECONDS  # more than one batch ran
        assert 0 < cell["batch_p50_ms"] < 200
