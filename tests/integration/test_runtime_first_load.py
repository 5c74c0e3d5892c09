"""The first variant a process loads is measured for itself, not for its runtime's own set-up.

``Runtime.load_sync`` measures a load as the RSS it adds. A process's first ONNX Runtime session also imports the
library and builds its environment and kernel registry (~30 MB in an agent): mlp-tiny, a 4.7 KB file, was measured
at 31.7 MB on a 25 MiB edge of the cascade benchmark's testbed, more than the edge's whole budget, and that edge
refused to load it ever again, so routing never had the cascade's first stage at the door. ``OnnxRuntime._prime``
opens a hand-written Identity model first. Each check runs in a fresh interpreter: this test process imported
ONNX Runtime long ago."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "variant_store" / "models" / "digits" / "mlp-tiny.onnx"


def _first_load_bytes(runtime: str) -> int:
    code = (f"from pathlib import Path\nfrom variant_store.runtimes.onnx_rt import OnnxRuntime\n"
            f"r = OnnxRuntime(Path({str(TINY)!r}), intra_op_threads=2)\n"
            + ("r._prime = lambda: None\n" if runtime == "unprimed" else "")
            + "r.load_sync()\nprint(r.memory_bytes)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_a_first_onnx_load_is_measured_without_onnx_runtimes_own_set_up() -> None:
    primed = _first_load_bytes("primed")
    unprimed = _first_load_bytes("unprimed")  # what the measurement was before: the library's set-up included
    assert unprimed > 8 << 20, unprimed
    assert primed < 4 << 20, primed  # a 4.7 KB model and its session, well under a 25 MiB edge's budget


def test_the_prime_model_is_a_valid_identity() -> None:
    import onnxruntime as ort

    from variant_store.runtimes.onnx_rt import PRIME_MODEL

    sess = ort.InferenceSession(PRIME_MODEL, providers=["CPUExecutionProvider"])
    x = np.array([1.5], dtype=np.float32)
    assert sess.run(None, {"x": x})[0].tolist() == [1.5]
