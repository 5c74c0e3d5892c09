"""Merging a cascade's answers row by row (``edge_agent.cascade_exec.merge_rows``), and the agent's cascade
counters as Prometheus reads them."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.cascade_exec import ESCALATED, LOCAL, merge_rows
from edge_agent.metrics import AgentMetrics
from mesh.errors import MeshError
from mesh.types import InferResponse, StageInfo
from mesh.v2.params import cascade_stages, response_parameters

pytestmark = pytest.mark.unit


def out(*rows: float) -> dict[str, np.ndarray]:
    return {"logits": np.array([[r, -r] for r in rows], dtype=np.float32)}


# (parts as (row indices, values), rows, merged first column)
MERGES = [
    ([([0, 2], (10.0, 12.0)), ([1, 3], (21.0, 23.0))], 4, [10.0, 21.0, 12.0, 23.0]),
    ([([0, 1, 2], (1.0, 2.0, 3.0))], 3, [1.0, 2.0, 3.0]),              # all answered by stage 1
    ([([], ()), ([0, 1], (5.0, 6.0))], 2, [5.0, 6.0]),                 # none answered by stage 1
    ([([1], (7.0,)), ([2], (8.0,)), ([0], (9.0,))], 3, [9.0, 7.0, 8.0]),  # three stages
]


@pytest.mark.parametrize(("parts", "n", "want"), MERGES)
def test_merge_in_row_order(parts: list[tuple[list[int], tuple[float, ...]]], n: int, want: list[float]) -> None:
    got = merge_rows([(np.array(i, dtype=np.int64), out(*v) if v else {"logits": np.zeros((0, 2), np.float32)})
                      for i, v in parts], n)
    assert got["logits"][:, 0].tolist() == want
    assert got["logits"].dtype == np.float32


# (parts, why it is refused)
BAD = [
    ([([0], out(1.0))], "unanswered"),
    ([([0], out(1.0)), ([1], {"probs": np.zeros((1, 2), np.float32)})], "different outputs"),
    ([([0], out(1.0)), ([1], {"logits": np.zeros((1, 3), np.float32)})], "not float32"),
    ([([0], out(1.0)), ([1], {"logits": np.zeros((1, 2), np.float64)})], "not float32"),
]


@pytest.mark.parametrize(("parts", "why"), BAD)
def test_merge_refuses_mismatched_stages(parts: list[tuple[list[int], dict[str, np.ndarray]]], why: str) -> None:
    with pytest.raises(MeshError, match=why):
        merge_rows([(np.array(i, dtype=np.int64), o) for i, o in parts], 2)


def test_cascade_counters_parse_as_prometheus() -> None:
    m = AgentMetrics("edge-a")
    m.known(tasks=["digits"], tenants=[], variants=["small", "big"], sites=["core"])
    one = StageInfo(1, "edge-a", "small", 1, 1, (0.95,))
    for reason, stages in ((LOCAL, (one,)), (LOCAL, (one,)),
                           (ESCALATED, (StageInfo(1, "edge-a", "small", 3, 1, (0.95, 0.2, 0.3)),
                                        StageInfo(2, "core", "big", 2, 2)))):
        m.cascade("digits", InferResponse("r", {}, "edge-a", "small", 0.9, reason, stages=stages))
    m.cascade("secret-task", InferResponse("r", {}, "edge-a", "small", 0.9, LOCAL, stages=(one,)))
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    queries = {(s.labels["task"], s.labels["site"], s.labels["answered"]): s.value
               for s in fams["tiermesh_cascade_queries"].samples if s.name.endswith("_total")}
    assert queries == {("digits", "edge-a", "local"): 2, ("digits", "edge-a", "escalated"): 1,
                       ("other", "edge-a", "local"): 1}
    rows = {(s.labels["task"], s.labels["stage"]): s.value
            for s in fams["tiermesh_cascade_rows"].samples if s.name.endswith("_total")}
    assert rows == {("digits", "1"): 3, ("digits", "2"): 2, ("other", "1"): 1}


@pytest.mark.parametrize("text", [None, 3, "", "not json", "{}", "[1]", '[{"stage": 1}]', "[" * 5000 + "]" * 5000,
                                  '[{"stage": "x", "site": "a", "variant": "v", "rows": 1, "answered": 1, '
                                  '"confidence": [], "total_ms": 1, "compute_ms": 1}]'])
def test_malformed_stages_in_a_reply_read_as_none(text: object) -> None:
    assert cascade_stages({"cascade_stages": text}) == ()


def test_stages_round_trip_through_reply_parameters() -> None:
    stages = (StageInfo(1, "edge-a", "small", 2, 1, (0.95, 0.4), 1.5, 0.5), StageInfo(2, "core", "big", 1, 1))
    params = response_parameters(InferResponse("r", {}, "core", "big", 0.97, ESCALATED, cascade="c1", stages=stages))
    assert params["cascade"] == "c1" and params["cascade_confidence"] == 0.4
    assert cascade_stages(params) == stages
    assert "cascade" not in response_parameters(InferResponse("r", {}, "core", "big", 0.97, "local"))
