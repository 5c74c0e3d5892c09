"""Issue 34 item 2: generation runs in a child with memory, CPU and time limits. A child that loops, sleeps,
allocates, crashes or leaves processes behind fails with the limit it hit, nothing is left running, and the
store (real etcd, real blobs, real ONNX Runtime) still registers and builds a good model afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mesh.errors import ModelRejected, VariantBuildError
from mesh.etcd.store import Store
from tests import helpers_sandbox as targets
from tests.helpers_models import digits_split, trained_mlp_onnx
from variant_store.blobs import BlobStore
from variant_store.build import build_task, register_model
from variant_store.catalog import Catalog
from variant_store.sandbox import SandboxLimits, run_sandboxed

pytestmark = pytest.mark.integration

_MiB = 1 << 20


def test_a_result_comes_back() -> None:
    out = run_sandboxed(targets.add, (1, 2), {"scale": 3})
    assert out["sum"] == 9 and out["pid"] != os.getpid() and out["path"] == Path("/tmp")


@pytest.mark.parametrize(("fn", "args", "limits", "limit", "words"), [
    (targets.spin_forever, (), SandboxLimits(cpu_seconds=1, wall_seconds=30), "cpu", "CPU-time limit of 1 s"),
    (targets.sleep_forever, (), SandboxLimits(wall_seconds=1.5), "time", "wall-clock limit of 1.5 s"),
    (targets.allocate, (2048,), SandboxLimits(memory_bytes=1024 * _MiB), "memory", "memory limit of 1024 MiB"),
    (targets.allocate, (2048,), SandboxLimits(memory_bytes=1024 * _MiB, memory_rlimit="data"), "memory",
     "memory limit of 1024 MiB"),
    (targets.crash, (), SandboxLimits(), "crash", "killed by SIGSEGV"),
    (targets.exit_with, (7,), SandboxLimits(), "crash", "exit code 7"),
    (targets.raise_value_error, (), SandboxLimits(), "error", "ValueError: the converter choked on node 'evil'"),
    (targets.unsafe_result, (), SandboxLimits(), "crash", "posix.system is not allowed"),
], ids=["cpu", "time", "memory", "memory-data", "segfault", "exit", "raises", "unsafe-result"])
def test_each_limit_is_named(fn: Callable[..., Any], args: tuple[Any, ...], limits: SandboxLimits, limit: str,
                             words: str, capfd: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    with pytest.raises(VariantBuildError) as info:
        run_sandboxed(fn, args, limits=limits)
    assert info.value.details["limit"] == limit, info.value.message
    assert words in info.value.message
    assert fn.__name__ in info.value.message  # which work failed
    assert time.monotonic() - started < 25
    assert "pwned" not in capfd.readouterr().out  # the unsafe result was never unpickled into a call


def test_a_crash_quotes_the_childs_stderr() -> None:
    with pytest.raises(VariantBuildError) as info:
        run_sandboxed(targets.crash)
    assert "Fatal Python error: Segmentation fault" in info.value.message  # the child's own words, its tail


def test_a_mesh_error_crosses_the_boundary_as_itself() -> None:
    with pytest.raises(VariantBuildError, match=r"^no variant for you$") as info:
        run_sandboxed(targets.raise_build_error)
    assert info.value.details["limit"] == "error"


def test_nothing_the_child_started_is_left_behind(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(VariantBuildError) as info:
        run_sandboxed(targets.spawn_and_hang, (str(pid_file),), limits=SandboxLimits(wall_seconds=3))
    assert info.value.details["limit"] == "time"
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(grandchild):
        with contextlib.suppress(ProcessLookupError):
            os.kill(grandchild, signal.SIGKILL)
        pytest.fail(f"the sandbox left its grandchild {grandchild} running")
    # the child itself: the autouse fixture of tests/conftest.py fails the test if any child is left


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_lambda_is_refused_before_any_process_starts() -> None:
    with pytest.raises(VariantBuildError, match="not a module-level function"):
        run_sandboxed(lambda: 1)


# real models through the store's own build -----------------------------------------------------------

def _digits_model(extra_nodes: list[onnx.NodeProto], extra_inits: list[onnx.TensorProto], tail: str) -> bytes:
    """x (N, 64) -> Gemm -> ``pre`` (N, 10); ``tail`` names the value added to it to make ``logits``."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.1, (10, 64)).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(10, np.float32), "b"), *extra_inits]
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["pre"], transB=1), *extra_nodes,
             helper.make_node("Add", ["pre", tail], ["logits"])]
    graph = helper.make_graph(nodes, "bomb", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def memory_bomb() -> bytes:
    """Passes every static check (a few hundred bytes, standard ops); running it fills a 4 GiB tensor whose
    shape is computed from the input."""
    side = numpy_helper.from_array(np.array([1 << 15], np.int64), "side")
    nodes = [helper.make_node("Shape", ["x"], ["xs"], start=1),               # [64]
             helper.make_node("Div", ["xs", "xs"], ["one"]),                   # [1]
             helper.make_node("Mul", ["one", "side"], ["dim"]),                # [32768]
             helper.make_node("Concat", ["dim", "dim"], ["big_shape"], axis=0),
             helper.make_node("ConstantOfShape", ["big_shape"], ["big"]),
             helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0)]
    return _digits_model(nodes, [side], "total")


def cpu_bomb(rounds: int = 200) -> bytes:
    """Passes every static check; each run multiplies two 1024 x 1024 matrices ``rounds`` times (~400 GFLOP),
    derived from the input so nothing folds at load time."""
    shape = numpy_helper.from_array(np.array([1024, 1024], np.int64), "shape")
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("ConstantOfShape", ["shape"], ["ones"],
                              value=numpy_helper.from_array(np.array([1e-3], np.float32))),
             helper.make_node("Add", ["ones", "s"], ["m0"])]
    for i in range(rounds):
        nodes.append(helper.make_node("MatMul", [f"m{i}", "ones"], [f"m{i + 1}"]))
    nodes.append(helper.make_node("ReduceMean", [f"m{rounds}"], ["total"], keepdims=0))
    return _digits_model(nodes, [shape], "total")


def _validation(path: Path) -> Path:
    split = digits_split()
    np.savez(path, x=split.x_val, y=split.y_val, calib_count=np.asarray(100, dtype=np.int64))
    return path


async def test_hostile_models_fail_their_own_build_and_the_store_keeps_building(store: Store, tmp_path: Path) -> None:
    catalog, blobs = Catalog(store), BlobStore(tmp_path / "blobs")
    val = _validation(tmp_path / "val.npz")
    kinds = ["onnx.fp32", "onnx.int8-dynamic"]

    # refused at the door: nothing stored, nothing recorded
    evil = tmp_path / "evil.onnx"
    evil.write_bytes(helper.make_model(helper.make_graph(
        [helper.make_node("Pwn", ["x"], ["logits"], domain="com.evil")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.evil", 1)]).SerializeToString())
    with pytest.raises(ModelRejected, match=r"com\.evil") as refused:
        await register_model(catalog, blobs, evil, val, "evil-task", "evil-fam", owner="acme")
    assert refused.value.reason == "custom_domain"  # checked in a child; the reason crossed back with it
    assert await catalog.list_models() == [] and blobs.digests() == []

    # past the door, they blow up only when run: each fails its own build, in the child, with its limit
    for name, data, limits, words in [
        ("mem", memory_bomb(), SandboxLimits(memory_bytes=1536 * _MiB), ("memory limit of 1536 MiB",)),
        ("cpu", cpu_bomb(), SandboxLimits(cpu_seconds=3, wall_seconds=60), ("CPU-time limit of 3 s",)),
    ]:
        path = tmp_path / f"{name}.onnx"
        path.write_bytes(data)
        await register_model(catalog, blobs, path, val, f"{name}-task", f"{name}-bomb", owner="acme")
        started = time.monotonic()
        report = await build_task(catalog, blobs, f"{name}-task", kinds=kinds, progress=False, repeats=3,
                                  sandbox=limits)
        assert time.monotonic() - started < 60
        assert report.built == [], name
        assert report.skipped and all(any(w in s.reason for w in words) for s in report.skipped), report.skipped
        assert await catalog.list_variants(f"{name}-task") == []

    # a build past its wall clock fails as a whole, reported, not raised
    good = trained_mlp_onnx(tmp_path / "mlp.onnx")
    await register_model(catalog, blobs, good, val, "digits-own", "acme-mlp", owner="acme")
    slow = await build_task(catalog, blobs, "digits-own", kinds=kinds, progress=False, repeats=3,
                            sandbox=SandboxLimits(wall_seconds=0.2))
    assert slow.built == [] and [s.kind for s in slow.skipped] == ["*"]
    assert "wall-clock limit" in slow.skipped[0].reason

    # and the same store then builds the good model, measured for real
    report = await build_task(catalog, blobs, "digits-own", kinds=kinds, progress=False, repeats=3)
    assert sorted(m.variant_id for m in report.built) == ["acme-mlp.onnx.fp32", "acme-mlp.onnx.int8-dynamic"]
    assert all(0.9 < m.accuracy <= 1.0 and blobs.has(m.blob_digest) for m in report.built)
    assert {v.variant_id for v in await catalog.list_variants("digits-own")} == {m.variant_id for m in report.built}


async def test_cancelling_the_caller_kills_the_child() -> None:
    import asyncio

    from variant_store.sandbox import run_sandboxed_async

    task = asyncio.create_task(run_sandboxed_async(targets.sleep_forever, limits=SandboxLimits(wall_seconds=60)))
    await asyncio.sleep(1.0)
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 5
    assert (await run_sandboxed_async(targets.add, (2, 3)))["sum"] == 5  # and the next run is unaffected
    # the autouse fixture of tests/conftest.py fails the test if the cancelled child is still running


async def test_a_check_that_dies_is_a_refusal_and_a_good_check_returns_its_summary(tmp_path: Path) -> None:
    from variant_store.model_check import check_upload

    path = trained_mlp_onnx(tmp_path / "mlp.onnx")
    summary = await check_upload(path)
    assert summary.ops == ("Gemm", "Relu") and summary.inputs == (("x", "float32", (-1, 64)),)
    with pytest.raises(ModelRejected) as info:
        await check_upload(path, sandbox=SandboxLimits(wall_seconds=0.05))
    assert info.value.reason == "checker" and info.value.details["limit"] == "time"
