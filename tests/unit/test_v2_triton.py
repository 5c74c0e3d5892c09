"""The pure parts of the edge's Triton routes: classification, model config, statistics, the repository index."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from edge_agent.metrics import AgentMetrics
from edge_agent.v2_extras import task_labels, tenant_counts
from mesh.errors import BadTensor, RequestError
from mesh.types import SLO, InferResponse, TaskSignature, TensorSpec, Timing
from mesh.v2.classify import MAX_CLASS_COUNT, class_count, classify
from mesh.v2.codec import decode_infer_request
from mesh.v2.triton import Counts, config_type, index_entry, signature_to_config, stats_entry

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("scores", "k", "labels", "want"), [
    ([0.1, 0.7, 0.2], 2, ("a", "b", "c"), [b"0.700000:1:b", b"0.200000:2:c"]),
    ([0.1, 0.7, 0.2], 1, None, [b"0.700000:1"]),                      # no labels: the index alone
    ([3, 3, 1], 3, ("x",), [b"3.000000:0:x", b"3.000000:1", b"1.000000:2"]),  # ties keep index order; short labels
    ([0.5, -1.0], 9, None, [b"0.500000:0", b"-1.000000:1"]),          # k beyond the classes is cut to them
])
def test_classify_one_row_as_triton_writes_it(scores: list[float], k: int, labels: tuple[str, ...] | None,
                                               want: list[bytes]) -> None:
    out = classify(np.array(scores), k, labels)
    assert out.dtype == object and out.tolist() == want


def test_classify_a_batch_row_by_row() -> None:
    logits = np.array([[0.0, 2.0, 1.0], [5.0, 4.0, 6.0]], dtype=np.float32)
    out = classify(logits, 2, task_labels("digit-classification"))
    assert out.shape == (2, 2)
    assert out.tolist() == [[b"2.000000:1:1", b"1.000000:2:2"], [b"6.000000:2:2", b"5.000000:0:0"]]


def test_classify_refuses_what_holds_no_scores() -> None:
    with pytest.raises(BadTensor, match="no class scores"):
        classify(np.array([b"a"], dtype=object), 1, None)
    with pytest.raises(BadTensor, match="scalar"):
        classify(np.array(1.0, dtype=np.float32), 1, None)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3", MAX_CLASS_COUNT + 1])
def test_class_count_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(RequestError, match="classification"):
        class_count(bad, "logits")


def test_the_codec_reads_each_outputs_class_count() -> None:
    head = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}],
            "outputs": [{"name": "logits", "parameters": {"classification": 3, "binary_data": True}},
                        {"name": "other"}]}
    dec = decode_infer_request(orjson.dumps(head))
    assert dec.classification == {"logits": 3} and dec.outputs == {"logits": True, "other": False}
    del head["outputs"][0]["parameters"]  # type: ignore[index, attr-defined]
    assert decode_infer_request(orjson.dumps(head)).classification is None
    head["outputs"][0]["parameters"] = {"classification": "3"}  # type: ignore[index]
    with pytest.raises(RequestError):
        decode_infer_request(orjson.dumps(head))


def test_config_leaves_out_the_batch_dimension_when_every_tensor_has_one() -> None:
    sig = TaskSignature("t", (TensorSpec("x", "float32", (-1, 64)), TensorSpec("ids", "int64", (-1,))),
                        (TensorSpec("text", "object", (-1, 2)),))
    cfg = signature_to_config(sig, 16)
    assert cfg["max_batch_size"] == 16 and cfg["backend"] == "tiermesh"
    assert cfg["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [64]},
                            {"name": "ids", "data_type": "TYPE_INT64", "dims": [1]}]
    assert cfg["output"] == [{"name": "text", "data_type": "TYPE_STRING", "dims": [2]}]
    fixed = TaskSignature("f", (TensorSpec("x", "uint8", (3, 4)),), (TensorSpec("y", "float16", (-1, 4)),))
    cfg = signature_to_config(fixed)
    assert cfg["max_batch_size"] == 0 and cfg["input"][0]["dims"] == [3, 4] and cfg["output"][0]["dims"] == [-1, 4]
    assert config_type("bool") == "TYPE_BOOL"


def test_stats_entry_and_index_entry_shapes() -> None:
    e = stats_entry("t", "v1", Counts(success=2, fail=1, rows=10, queue_ms=1.5, compute_ms=2.0, total_ms=4.0))
    s = e["inference_stats"]
    assert e["inference_count"] == 10 and e["execution_count"] == 2
    assert s["success"] == {"count": 2, "ns": 4_000_000} and s["fail"] == {"count": 1, "ns": 0}
    assert s["queue"]["ns"] == 1_500_000 and s["compute_infer"]["ns"] == 2_000_000
    # every field perf_analyzer reads without checking it is there (its JSON ParseStatistics)
    assert set(s) == {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
                      "cache_miss"}
    assert all(type(v["count"]) is int and type(v["ns"]) is int and v["ns"] >= 0 for v in s.values())
    assert index_entry("t", True, "why") == {"name": "t", "version": "", "state": "READY", "reason": ""}
    assert index_entry("t", False, "why")["state"] == "UNAVAILABLE"


def _resp(variant: str, rows: int) -> InferResponse:
    return InferResponse("r", {"y": np.zeros((rows, 2), np.float32)}, "edge", variant, 0.9, "local_ok", False,
                         "acme", Timing(network_ms=0.0, queue_ms=1.0, compute_ms=2.0, total_ms=4.0), ["edge"])


def test_tenant_counts_keep_to_the_callers_tenant_and_its_tasks() -> None:
    m = AgentMetrics("edge")
    m.known(tasks=["t", "u"], tenants=["acme", "globex"], variants=["v1", "v2"], sites=[])
    slo = SLO.parse(100, 0.0, None, "latency")
    m.door_ok("t", "acme", slo, _resp("v1", 3))
    m.door_ok("t", "acme", slo, _resp("v2", 2))
    m.door_error("t", "acme", "bad_tensor")
    m.door_ok("t", "globex", slo, _resp("v1", 7))
    m.door_ok("u", "acme", slo, _resp("v1", 1))
    got = tenant_counts(m, "acme", {"t"})
    assert set(got) == {("t", ""), ("t", "v1"), ("t", "v2")}
    assert got[("t", "")] == Counts(success=2, fail=1, rows=5, queue_ms=2.0, compute_ms=4.0, total_ms=8.0)
    assert got[("t", "v1")].rows == 3 and got[("t", "v1")].fail == 0
    assert tenant_counts(m, "stranger", {"t"}) == {}  # counted as "other": a crowd, not the caller
    assert tenant_counts(None, "acme", {"t"}) == {}
