"""A query's id and deadline are set once, where it enters the mesh (``InferRequest.entering``)."""

from __future__ import annotations

import numpy as np
import pytest

from mesh.types import SLO, InferRequest, new_request_id

pytestmark = pytest.mark.unit


def test_entering_sets_the_deadline_from_the_whole_budget() -> None:
    x = {"x": np.ones((1, 2), np.float32)}
    req = InferRequest.entering("t", x, SLO(250.0), "acme", "caller-id", now=1000.0)
    assert req.deadline == pytest.approx(1000.25) and req.request_id == "caller-id"
    assert req.remaining_ms(now=1000.0) == pytest.approx(250.0)
    assert req.tenant == "acme" and req.hops == [] and req.inputs is x


def test_entering_without_an_id_gets_a_fresh_one() -> None:
    a = InferRequest.entering("t", {}, SLO(10.0))
    b = InferRequest.entering("t", {}, SLO(10.0), request_id="")
    assert a.request_id and b.request_id and a.request_id != b.request_id
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) <= 64 for i in ids)
