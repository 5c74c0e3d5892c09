"""Running a cascade (issue 33, ``edge_agent.cascade_exec``) over real ONNX models: a small digits MLP as stage 1, a
wide one as stage 2, each served by onnxruntime (``tests.helpers_dataplane.OnnxDataPlane``). A confident row is
answered by stage 1, an unsure one escalated, a multi-row mix escalates its unsure rows together and merges the
answers in order, a failing stage 2 fails the query naming it; the reply's parameters carry every stage and the
SDK's decoder reads them back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from core_scheduler.policy.routing import Decision
from core_scheduler.policy.routing_cascade import CascadePlan
from edge_agent.cascade_exec import ESCALATED, LOCAL, StageRun, door_runner, run_cascade
from edge_agent.paths import attempt_ms
from edge_agent.traces import HopTrace
from mesh.client import Client
from mesh.errors import MeshError, RuntimeLoadError
from mesh.types import SLO, InferRequest, InferResponse, TaskSignature, check_inputs
from mesh.v2 import grpc_messages as oip
from mesh.v2.grpc_codec import encode_infer_response
from mesh.v2.params import cascade_stages, response_parameters
from tests.helpers_dataplane import OnnxDataPlane, serve_in_thread
from tests.helpers_models import digits_split, trained_mlp_onnx
from variant_store.cascade_meta import confidence

pytestmark = pytest.mark.integration

THRESHOLD = 0.9


@pytest.fixture(scope="module")
def planes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[OnnxDataPlane, OnnxDataPlane]]:
    d = tmp_path_factory.mktemp("cascade")
    small = OnnxDataPlane("edge-a", trained_mlp_onnx(d / "small.onnx", (4,)), task="digits")
    big = OnnxDataPlane("core", trained_mlp_onnx(d / "big.onnx", (64,)), task="digits")
    try:
        yield small, big
    finally:
        small.close()
        big.close()


def plan() -> CascadePlan:
    return CascadePlan(cascade_id="c1", rule="max_softmax", thresholds=(THRESHOLD,), variants=("small", "big"),
                       sites=("edge-a", "core"), stage_ms=(1.0, 20.0), expected_ms=5.0, escalated_ms=21.0, cost=1e-9,
                       accuracy=0.97, escalation=(0.2,))


def rows_by_confidence(small: OnnxDataPlane) -> tuple[np.ndarray, np.ndarray]:
    """Validation rows stage 1 is sure of, and rows it is not."""
    x = digits_split().x_val
    conf = confidence("max_softmax", small.run_direct({"x": x})["logits"])
    return x[conf >= THRESHOLD], x[conf < THRESHOLD]


class Runner:
    """Runs each stage on its plane, as the door's runner would; records what each stage was asked."""

    def __init__(self, small: OnnxDataPlane, big: OnnxDataPlane, fail: int = 0) -> None:
        self.planes = {"small": small, "big": big}
        self.asked: list[tuple[int, int]] = []   # (stage, rows)
        self.fail = fail

    async def __call__(self, s: StageRun) -> InferResponse:
        self.asked.append((s.stage, len(s.inputs["x"])))
        if s.stage == self.fail:
            raise RuntimeLoadError(f"{s.variant} could not load at {s.site}: disk full")
        req = InferRequest.entering("digits", s.inputs, SLO(latency_ms=5000.0))
        return await self.planes[s.variant].infer(req)


def serve(runner: Runner, x: np.ndarray) -> InferResponse:
    return asyncio.run(run_cascade(plan(), {"x": x}, "logits", runner, request_id="r1", tenant="public"))


def test_confident_row_answered_by_stage_one(planes: tuple[OnnxDataPlane, OnnxDataPlane]) -> None:
    small, big = planes
    sure, _ = rows_by_confidence(small)
    runner = Runner(small, big)
    resp = serve(runner, sure[:1])
    assert runner.asked == [(1, 1)]
    assert resp.reason == LOCAL and resp.site == "edge-a" and resp.accuracy == 0.97
    np.testing.assert_array_equal(resp.outputs["logits"], small.run_direct({"x": sure[:1]})["logits"])
    (st,) = resp.stages
    assert (st.stage, st.site, st.rows, st.answered) == (1, "edge-a", 1, 1) and st.confidence[0] >= THRESHOLD


def test_unsure_row_escalated(planes: tuple[OnnxDataPlane, OnnxDataPlane]) -> None:
    small, big = planes
    _, unsure = rows_by_confidence(small)
    runner = Runner(small, big)
    resp = serve(runner, unsure[:1])
    assert runner.asked == [(1, 1), (2, 1)]
    assert resp.reason == ESCALATED and resp.site == "core"
    np.testing.assert_array_equal(resp.outputs["logits"], big.run_direct({"x": unsure[:1]})["logits"])
    one, two = resp.stages
    assert (one.rows, one.answered, two.rows, two.answered) == (1, 0, 1, 1) and one.confidence[0] < THRESHOLD
    params = response_parameters(resp)
    assert params["reason"] == ESCALATED and params["cascade"] == "c1"
    assert params["cascade_confidence"] == pytest.approx(one.confidence[0], abs=1e-6)
    assert [(s.stage, s.site, s.variant) for s in cascade_stages(params)] == [(1, "edge-a", small.variant),
                                                                             (2, "core", big.variant)]


def test_multi_row_mix_escalates_unsure_rows_together_and_merges_in_order(
        planes: tuple[OnnxDataPlane, OnnxDataPlane]) -> None:
    small, big = planes
    sure, unsure = rows_by_confidence(small)
    x = np.stack([sure[0], unsure[0], sure[1], unsure[1], unsure[2], sure[2]])
    runner = Runner(small, big)
    resp = serve(runner, x)
    assert runner.asked == [(1, 6), (2, 3)]  # one stage-2 query of the three unsure rows
    want = small.run_direct({"x": x})["logits"]
    want[[1, 3, 4]] = big.run_direct({"x": x[[1, 3, 4]]})["logits"]
    np.testing.assert_allclose(resp.outputs["logits"], want, rtol=1e-6, atol=1e-6)
    one, two = resp.stages
    assert (one.rows, one.answered, two.rows, two.answered) == (6, 3, 3, 3)
    assert resp.reason == ESCALATED


def test_failing_stage_two_is_named(planes: tuple[OnnxDataPlane, OnnxDataPlane]) -> None:
    small, big = planes
    _, unsure = rows_by_confidence(small)
    with pytest.raises(RuntimeLoadError) as err:
        serve(Runner(small, big, fail=2), unsure[:2])
    assert "cascade c1 stage 2 (big at core) failed" in err.value.message and "disk full" in err.value.message
    assert err.value.details["stage"] == 2 and err.value.details["stage_site"] == "core"


def test_a_stage_without_logits_fails_named(planes: tuple[OnnxDataPlane, OnnxDataPlane]) -> None:
    small, big = planes
    with pytest.raises(MeshError) as err:
        asyncio.run(run_cascade(plan(), {"x": digits_split().x_val[:2]}, "probabilities", Runner(small, big),
                                request_id="r2", tenant="public"))
    assert "stage 1" in err.value.message and "logits" in err.value.message


class CascadePlane:
    """A data plane whose every query is served by the cascade over the two planes (the door's part of it)."""

    def __init__(self, small: OnnxDataPlane, big: OnnxDataPlane) -> None:
        self.site = "edge-a"
        self.small, self.big = small, big

    def task_signature(self, task: str) -> TaskSignature:
        return self.small.task_signature(task)

    def tasks(self) -> list[str]:
        return ["digits"]

    def ready(self) -> bool:
        return True

    async def infer(self, req: InferRequest) -> InferResponse:
        req.inputs = check_inputs(self.small.signature.inputs, req.inputs)
        return await run_cascade(plan(), req.inputs, "logits", Runner(self.small, self.big),
                                 request_id=req.request_id, tenant=req.tenant)


def test_rest_reply_and_sdk_result_carry_the_stages(planes: tuple[OnnxDataPlane, OnnxDataPlane]) -> None:
    small, big = planes
    sure, unsure = rows_by_confidence(small)
    with serve_in_thread(CascadePlane(small, big), host="127.0.0.1", port=0) as server, \
            Client(server.url, timeout=30) as client:
        local = client.infer("digits", sure[:1], latency_ms=5000)
        up = client.infer("digits", unsure[:1], latency_ms=5000)
    assert local.reason == LOCAL and [(s.stage, s.site, s.answered) for s in local.stages] == [(1, "edge-a", 1)]
    assert up.reason == ESCALATED and [(s.stage, s.site, s.answered) for s in up.stages] == [(1, "edge-a", 0),
                                                                                             (2, "core", 1)]
    assert up.site == "core" and up.stages[0].confidence[0] < THRESHOLD <= local.stages[0].confidence[0]
    np.testing.assert_allclose(up.output("logits"), big.run_direct({"x": unsure[:1]})["logits"], rtol=1e-6)


def test_grpc_reply_parameters_carry_the_stages(planes: tuple[OnnxDataPlane, OnnxDataPlane]) -> None:
    small, big = planes
    _, unsure = rows_by_confidence(small)
    resp = serve(Runner(small, big), unsure[:2])
    msg = encode_infer_response("digits", "r1", resp.outputs, response_parameters(resp))
    params = oip.params_of(oip.ModelInferResponse.FromString(msg.SerializeToString()).parameters)
    assert params["reason"] == ESCALATED and params["cascade"] == "c1"
    got = cascade_stages(params)
    assert [(s.stage, s.site, s.variant, s.rows, s.answered) for s in got] == \
        [(s.stage, s.site, s.variant, s.rows, s.answered) for s in resp.stages]
    assert got[0].confidence == pytest.approx(resp.stages[0].confidence, abs=1e-6)


def test_door_runner_serves_here_or_forwards_and_traces_each_stage(
        planes: tuple[OnnxDataPlane, OnnxDataPlane]) -> None:
    """The door's runner: stage 1's site is the door (served locally), stage 2's another site (forwarded, pinned to
    its variant); a traced query gets a record per stage and one for the answer."""
    small, big = planes
    _, unsure = rows_by_confidence(small)
    calls: list[tuple[str, str, str]] = []

    async def local(sub: InferRequest, variant: str) -> InferResponse:
        calls.append(("local", variant, ""))
        return await small.infer(sub)

    async def forward(sub: InferRequest, d: Decision) -> InferResponse:
        calls.append(("forward", d.variant_id, d.site))
        # a stage is not retried, so its forward is not cut at an attempt's share of the budget
        assert attempt_ms(4000.0, d.expected_latency_ms, best_effort=d.best_effort) == 4000.0
        return await big.infer(InferRequest.entering("digits", sub.inputs, sub.slo))

    async def go() -> tuple[InferResponse, HopTrace]:
        req = InferRequest.entering("digits", {"x": unsure[:2]}, SLO(latency_ms=5000.0))
        hop = HopTrace("edge-a", "edge")
        run = door_runner("edge-a", req, hop, local=local, forward=forward)
        return await run_cascade(plan(), req.inputs, "logits", run, request_id=req.request_id, tenant="public",
                                 hop=hop), hop

    resp, hop = asyncio.run(go())
    assert calls == [("local", "small", ""), ("forward", "big", "core")]
    choices = [(r["choice"]["reason"], r["choice"]["site"], r["choice"]["variant"]) for r in hop.records]
    assert choices == [("cascade_stage_1", "edge-a", "small"), ("cascade_stage_2", "core", "big"),
                       (ESCALATED, "core", big.variant)]
    assert hop.records[0]["timings_ms"]["compute"] > 0 and resp.reason == ESCALATED
