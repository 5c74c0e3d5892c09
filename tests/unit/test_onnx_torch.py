"""The ONNX-to-torch interpreter on the CPU: every committed digits model gives ONNX Runtime's
outputs (FP32 tight, FP16 looser), unsupported ops are refused at load, and the runtime keeps the
declared output dtype. Needs torch (the ``convert`` or ``gpu`` extra); skipped with the reason without."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mesh.errors import RuntimeLoadError
from variant_store.families.datasets import load_validation_npz

torch = pytest.importorskip("torch", reason="torch is not installed (the 'convert' or 'gpu' extra)")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from variant_store.runtimes import open_runtime  # noqa: E402
from variant_store.runtimes.onnx_torch import TorchGraph  # noqa: E402

pytestmark = pytest.mark.unit

MODELS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"
DIGITS = ["mlp-tiny", "mlp-wide", "cnn-small", "cnn-large", "backbone", "head-digits", "head-parity"]


def _inputs(name: str) -> np.ndarray:
    x = load_validation_npz().x_holdout
    if name.startswith("head"):  # heads take backbone features
        sess = ort.InferenceSession(str(MODELS / "backbone.onnx"), providers=["CPUExecutionProvider"])
        return np.asarray(sess.run(None, {"x": x})[0])
    return x


@pytest.mark.parametrize("name", DIGITS)
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_matches_onnxruntime(name: str, half: bool) -> None:
    path = MODELS / f"{name}.onnx"
    x = _inputs(name)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    in_name = sess.get_inputs()[0].name
    ref = np.asarray(sess.run(None, {in_name: x})[0])
    graph = TorchGraph(onnx.load(str(path)), "cpu", half=half)
    out = next(iter(graph({in_name: torch.from_numpy(x)}).values()))
    assert out.dtype == torch.float32  # the declared output dtype, also in FP16 mode
    scale = float(np.abs(ref).max())
    err = float(np.abs(out.numpy() - ref).max())
    assert err <= (5e-3 * scale if half else 1e-5 * scale), (name, err, scale)
    if not half or name != "head-parity":
        assert np.mean(out.numpy().argmax(1) == ref.argmax(1)) >= (0.99 if half else 1.0)


def _one_node(op: str, reads: str) -> Any:
    """A model of one ``op`` node reading ``reads`` into ``y``, with a float input ``x`` of 4 columns."""
    from onnx import TensorProto, helper

    node = helper.make_node(op, [reads], ["y"])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])])
    return helper.make_model(g)


def test_unsupported_op_is_refused_at_load() -> None:
    with pytest.raises(RuntimeLoadError, match="unsupported ONNX op Celu"):
        TorchGraph(_one_node("Celu", "x"), "cpu")


def test_flatten_at_rank_and_shape_folding() -> None:
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Flatten", ["x"], ["f"], axis=2),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Reshape", ["f", "s"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])])
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = TorchGraph(helper.make_model(g), "cpu")({"x": x})["y"]
    assert torch.equal(out, x)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_runtime_on_cpu_device(precision: str) -> None:
    rt = open_runtime("torch-cuda", MODELS / "cnn-small.onnx", device="cpu", precision=precision)
    rt.load_sync()
    try:
        assert rt.providers_in_use == [f"torch-cpu-{precision}-eager"]
        assert [(s.name, s.dtype, s.shape) for s in rt.output_specs] == [("logits", "float32", (-1, 10))]
        x = load_validation_npz().x_holdout
        out = rt.infer_sync({"x": x})["logits"]
        assert out.dtype == np.float32 and out.shape == (len(x), 10)
        acc = float(np.mean(out.argmax(1) == load_validation_npz().y_holdout))
        assert acc >= 0.97
    finally:
        rt.unload_sync()


def test_bad_precision_is_refused() -> None:
    with pytest.raises(RuntimeLoadError, match="precision"):
        open_runtime("torch-cuda", MODELS / "cnn-small.onnx", precision="int4")


def test_an_fp16_variant_as_the_build_writes_it(tmp_path: Path) -> None:
    """The float16 converter appends the casts of the graph's inputs after the nodes that read them; the
    interpreter orders the nodes as ONNX Runtime does (on a lent H100 the site failed to profile such files)."""
    from variant_store.generate import generate_variants

    x = load_validation_npz().x_holdout
    gen, skipped = generate_variants(MODELS / "cnn-small.onnx", x[:50], tmp_path, kinds=["onnx.fp16"])
    assert not skipped
    model = onnx.load(str(gen[0].path))
    assert model.graph.node[-1].op_type == "Cast"  # the out-of-order file this is about
    ref = np.asarray(ort.InferenceSession(str(gen[0].path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0])
    out = next(iter(TorchGraph(model, "cpu")({"x": torch.from_numpy(x)}).values())).numpy()
    assert float(np.abs(out - ref).max()) <= 1e-3 * float(np.abs(ref).max())


def test_a_graph_reading_what_nothing_produces_is_refused() -> None:
    with pytest.raises(RuntimeLoadError, match="never produced"):
        TorchGraph(_one_node("Relu", "nowhere"), "cpu")


def test_the_torch_runtime_is_primed_before_its_first_load_is_measured() -> None:
    """torch (and, on a GPU, the CUDA context and math libraries) is set up by ``_prime`` before the first
    load's memory is measured: mlp-tiny (a 50 KB file) is not charged torch's import (~200 MB)."""
    import subprocess
    import sys

    code = ("from pathlib import Path; from variant_store.runtimes import open_runtime\n"
            "rt = open_runtime('torch-cuda', Path('variant_store/models/digits/mlp-tiny.onnx'), device='cpu')\n"
            "rt.load_sync(); print(rt.memory_bytes)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) < 32 << 20
