"""Pipelines' pure parts (issue 33, item 2): the budget split across stages, the graph checks at registration
(cycle, unknown task, mismatched signature, Switch table) and the catalog entry decoded as hostile input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edge_agent.pipeline_exec import feed, split_budget, stage_latency_ms
from mesh.errors import PipelineRefused
from mesh.types import TaskSignature, TensorSpec
from variant_store.meta import LatencyStats, Profile, VariantMeta
from variant_store.pipeline_catalog import Graph, decode_pipeline, graph_from_yaml, plan_graph
from variant_store.pipeline_meta import PipelineMeta, Stage


def sig(task: str, ins: list[tuple[str, str, tuple[int, ...]]], outs: list[tuple[str, str, tuple[int, ...]]]
        ) -> TaskSignature:
    return TaskSignature(task, tuple(TensorSpec(*i) for i in ins), tuple(TensorSpec(*o) for o in outs))


SIGS = {
    "detect": sig("detect", [("image", "float32", (-1, 64))], [("boxes", "float32", (-1, 16))]),
    "recognise": sig("recognise", [("boxes", "float32", (-1, 16))], [("logits", "float32", (-1, 10))]),
    "recognise-int": sig("recognise-int", [("boxes", "int64", (-1, 16))], [("logits", "float32", (-1, 10))]),
    "group": sig("group", [("text", "object", (-1,))], [("logits", "float32", (-1, 3))]),
    "head-a": sig("head-a", [("text", "object", (-1,))], [("logits", "float32", (-1, 10))]),
    "head-b": sig("head-b", [("text", "object", (-1,))], [("logits", "float32", (-1, 10))]),
    "head-5": sig("head-5", [("text", "object", (-1,))], [("logits", "float32", (-1, 5))]),
}


def seq(*tasks: str) -> Graph:
    return Graph("sequence", tuple((t, None) for t in tasks))


def switch(table: dict[int, str], select: str = "logits") -> Graph:
    return Graph("switch", (("group", None),), select, tuple(sorted(table.items())),
                 tuple((t, None) for t in dict.fromkeys(table.values())))


def test_sequence_feeds_by_name_and_derives_the_signature() -> None:
    stages, branches, s = plan_graph("ocr", seq("detect", "recognise"), SIGS, {})
    assert [(st.task, st.feeds) for st in stages] == [("detect", (("image", "input.image"),)),
                                                     ("recognise", (("boxes", "prev.boxes"),))]
    assert branches == () and s.task == "ocr"
    assert [(i.name, i.dtype, i.shape) for i in s.inputs] == [("image", "float32", (-1, 64))]
    assert [o.name for o in s.outputs] == ["logits"]


@pytest.mark.parametrize(("graph", "reason", "words"), [
    (seq("detect", "nowhere"), "unknown_task", "'nowhere' is not catalogued"),
    (seq("detect", "recognise-int"), "signature", "int64"),
    (Graph("sequence", (("detect", None), ("recognise", {"boxes": "input.image"}))), "signature",
     "pipeline input image float32[-1, 64] cannot feed"),
    (Graph("sequence", (("detect", None), ("recognise", {"boxes": "prev.nope"}))), "signature", "prev.nope"),
    (Graph("sequence", (("detect", None), ("recognise", {"boxes": "prev.boxes", "x": "input.x"}))), "signature",
     "takes inputs"),
    (seq("detect", "ocr"), "cycle", "ocr -> ocr"),
    (switch({0: "head-a", 3: "head-b"}), "table", "class 3"),
    (switch({0: "head-a", 1: "head-5"}), "signature", "branches answer differently"),
    (switch({0: "head-a"}, select="nope"), "signature", "no output 'nope'"),
])
def test_bad_graphs_are_refused(graph: Graph, reason: str, words: str) -> None:
    with pytest.raises(PipelineRefused) as err:
        plan_graph("ocr", graph, SIGS, {})
    assert err.value.reason == reason and words in err.value.message, err.value.message


def test_a_cycle_through_another_pipeline_is_refused() -> None:
    _, _, inner_sig = plan_graph("inner", seq("detect", "recognise"), SIGS, {})
    inner = PipelineMeta(task="inner", kind="sequence", stages=(Stage("outer", (("image", "input.image"),)),),
                         signature=inner_sig)
    with pytest.raises(PipelineRefused, match="outer -> inner -> outer") as err:
        plan_graph("outer", seq("inner"), SIGS, {"inner": inner})
    assert err.value.reason == "cycle"


def test_a_pipeline_name_taken_by_a_task_is_refused() -> None:
    with pytest.raises(PipelineRefused) as err:
        plan_graph("detect", seq("recognise"), SIGS, {})
    assert err.value.reason == "name"


def test_switch_table_and_branches() -> None:
    _, branches, s = plan_graph("sections", switch({0: "head-a", 1: "head-b", 2: "head-a"}), SIGS, {})
    assert [b.task for b in branches] == ["head-a", "head-b"]
    assert branches[0].feeds == (("text", "input.text"),)  # the selector outputs no text: from the input
    assert [o.shape for o in s.outputs] == [(-1, 10)] and [i.name for i in s.inputs] == ["text"]


@pytest.mark.parametrize(("doc", "reason"), [
    ({"kind": "loop"}, "graph"),
    ({"kind": "sequence", "stages": []}, "graph"),
    ({"kind": "sequence", "stages": [{"task": "a", "feeds": {"x": 3}}]}, "graph"),
    ({"kind": "sequence", "stages": ["a"], "extra": 1}, "graph"),
    ({"kind": "switch", "select": {"task": "g"}, "table": {0: "a"}}, "graph"),
    ({"kind": "switch", "select": {"task": "g", "output": "l"}, "table": {"x": "a"}}, "table"),
    ({"kind": "switch", "select": {"task": "g", "output": "l"}, "table": {}}, "table"),
    ({"kind": "switch", "select": {"task": "g", "output": "l"}, "table": {0: "a"}, "branches": ["b"]}, "table"),
    ([1, 2], "graph"),
])
def test_hostile_graph_documents(doc: Any, reason: str) -> None:
    with pytest.raises(PipelineRefused) as err:
        graph_from_yaml(doc, "p")
    assert err.value.reason == reason


def test_switch_document_parses() -> None:
    g = graph_from_yaml({"kind": "switch", "select": {"task": "group", "output": "logits"},
                         "table": {0: "head-a", "1": "head-b"}}, "p")
    assert g.table == ((0, "head-a"), (1, "head-b")) and g.select == "logits"
    assert [t for t, _ in g.branches] == ["head-a", "head-b"]


def entry() -> dict[str, Any]:
    stages, branches, s = plan_graph("sections", switch({0: "head-a", 1: "head-b"}), SIGS, {})
    return PipelineMeta(task="sections", kind="switch", stages=stages, signature=s, select="logits",
                        table=((0, "head-a"), (1, "head-b")), branches=branches, accuracy=0.8, heldout_rows=10,
                        stage_accuracy=(("group", 0.9),)).to_json()


def test_entry_round_trips() -> None:
    meta = decode_pipeline("pipelines/sections", entry())
    assert meta.to_json() == entry() and meta.floor("group") == 0.9 and meta.floor("head-a") == 0.0


@pytest.mark.parametrize("change", [
    {"task": "other"}, {"kind": "ensemble"}, {"accuracy": 1.5}, {"accuracy": True}, {"table": {"0": "head-z"}},
    {"table": {"-1": "head-a"}}, {"stages": "x"}, {"stages": [{"task": "a", "feeds": {"t": "elsewhere.t"}}]},
    {"stage_accuracy": {"nowhere": 0.5}}, {"heldout_rows": 0}, {"schema": 2}, {"signature": {"task": "x"}},
    {"created": float("nan")}, {"select": ""},
])
def test_malformed_entries_raise_value_error_only(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        decode_pipeline("pipelines/sections", {**entry(), **change})


def test_entry_under_another_key_is_refused() -> None:
    with pytest.raises(ValueError, match="not its key"):
        decode_pipeline("pipelines/elsewhere", entry())


@pytest.mark.parametrize(("total", "costs", "want"), [
    (100.0, [1.0, 3.0], [25.0, 75.0]),
    (90.0, [None, None, None], [30.0, 30.0, 30.0]),
    (60.0, [2.0, None], [30.0, 30.0]),          # unknown counts as the mean of the known
    (60.0, [0.0, 4.0], [30.0, 30.0]),           # so does a cost of zero
    (10.0, [1.0], [10.0]),
    (0.0, [1.0, 2.0], [0.0, 0.0]),
    (-5.0, [1.0, 2.0], [0.0, 0.0]),
    (50.0, [], []),
])
def test_split_budget(total: float, costs: list[float | None], want: list[float]) -> None:
    got = split_budget(total, costs)
    assert got == pytest.approx(want)
    if total > 0 and costs:
        assert sum(got) == pytest.approx(total)


def _variant(vid: str, accuracy: float, p50: dict[int, float]) -> VariantMeta:
    return VariantMeta(task="t", family="f", variant_id=vid, format="onnx", precision="fp32",  # type: ignore[arg-type]
                       runtime="onnxruntime", blob_digest="a" * 64, size_bytes=1, accuracy=accuracy,
                       profiles={"cpu": Profile("cpu", 1.0, {b: LatencyStats(ms, ms) for b, ms in p50.items()}, 1)})


def test_stage_latency_is_the_fastest_profile_meeting_the_floor() -> None:
    vs = {"fast": _variant("fast", 0.7, {1: 1.0, 8: 4.0}), "good": _variant("good", 0.9, {1: 5.0, 8: 9.0})}
    assert stage_latency_ms(vs, 1) == 1.0
    assert stage_latency_ms(vs, 8) == 4.0
    assert stage_latency_ms(vs, 1, floor=0.8) == 5.0
    assert stage_latency_ms(vs, 1, floor=0.95) is None
    assert stage_latency_ms(None, 1) is None


def test_feed_takes_inputs_and_previous_outputs_by_name() -> None:
    st = Stage("recognise", (("boxes", "prev.b"), ("image", "input.image")))
    got = feed(st, {"image": np.ones(2)}, {"b": np.zeros(2)})
    assert set(got) == {"boxes", "image"} and got["boxes"].sum() == 0


def test_view_state_follows_pipelines_and_keeps_the_last_good_entry() -> None:
    from core_scheduler.state.view_state import ViewState
    from mesh.errors import ProtocolError

    state = ViewState()
    assert state.put("pipelines/sections", entry(), 5) == "pipeline"
    assert state.pipelines["sections"].kind == "switch" and state.revisions["pipeline"] == 5
    after = ViewState()
    got = after.put("pipelines/sections", {"task": "sections", "kind": "loop"}, 6, before=state)
    assert isinstance(got, ProtocolError) and "pipelines/sections" in after.rejected
    assert after.pipelines["sections"] == state.pipelines["sections"]  # the last good one kept
    assert isinstance(after.put("pipelines/other", entry(), 7), ProtocolError)  # names another task than its key
    assert after.delete("pipelines/sections", 8) == "pipeline" and "sections" not in after.pipelines
    assert "pipelines/sections" not in after.rejected
