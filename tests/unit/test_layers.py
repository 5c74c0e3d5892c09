"""The layers of DESIGN.md hold, and the check that holds them fails when one is broken.

``make test`` runs ``lint-imports`` with the contracts in ``pyproject.toml``; these tests show the
contracts bite (an upward import in a copy of the tree breaks them) and that an SDK user's
``import mesh`` loads none of the servers' code.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mesh", "topology", "variant_store", "core_scheduler", "edge_agent", "console", "tiermesh", "bench")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _tree_copy(dst: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "models", "results"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=tree, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, timeout=120, check=False)


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


@pytest.fixture(scope="module")
def lint_available() -> None:
    if not LINT_IMPORTS.exists():
        pytest.skip(f"lint-imports is not installed beside {sys.executable} (the 'dev' extra installs it)")


def test_the_contracts_hold_on_this_tree(tmp_path: Path, lint_available: None) -> None:
    res = _lint(_tree_copy(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "BROKEN" not in res.stdout and "KEPT" in res.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("core_scheduler/scheduler.py", "import edge_agent.agent", "Layers"),
    ("mesh/types.py", "import topology.schema", "Layers"),
    ("topology/schema.py", "import variant_store.meta", "Layers"),
    ("edge_agent/agent.py", "import tiermesh.harness", "Layers"),
    ("mesh/client.py", "import mesh.etcd.store", "Inside mesh"),
    ("core_scheduler/state/view.py", "import grpclib", "Only mesh.etcd"),
    ("edge_agent/site_dataplane.py", "import zmq", "Only mesh.zmq"),
    ("mesh/pki/curve.py", "import zmq", "Only mesh.zmq"),  # CURVE keys are made without pyzmq
    ("console/app.py", "import edge_agent.mtls", "Layers"),  # the console stands beside the agent, not on it
    ("core_scheduler/scheduler.py", "import console.server", "Layers"),
    ("mesh/zmq/base.py", "from mesh.zmq import sync", "No import loops"),
])
def test_one_upward_import_breaks_a_contract(tmp_path: Path, lint_available: None, module: str, line: str,
                                             contract: str) -> None:
    tree = _tree_copy(tmp_path)
    _append(tree / module, line)
    res = _lint(tree)
    assert res.returncode != 0, f"{line!r} in {module} went unnoticed:\n{res.stdout}"
    broken = res.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, broken


def test_importing_the_sdk_loads_no_server_code() -> None:
    # mesh.Client is imported on first use (PEP 562): touch it, as a caller does
    probe = ("import sys, mesh; mesh.Client; print(' '.join(sorted(m for m in sys.modules)))")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)
    loaded = set(res.stdout.split())
    assert "mesh.client" in loaded
    for banned in ("mesh.etcd", "mesh.zmq", "aetcd", "zmq", "grpc", "grpclib", "core_scheduler", "edge_agent",
                   "tiermesh", "topology", "variant_store", "onnxruntime", "scipy", "sklearn", "pydantic"):
        assert not any(m == banned or m.startswith(banned + ".") for m in loaded), banned


def test_an_idle_agent_loads_no_heavy_library() -> None:
    # an edge agent with nothing placed is a small process (bench/footprint.py): ONNX Runtime comes with the first
    # variant it loads, cryptography with credentials (CURVE, mutual TLS), never with the import; etcd is spoken
    # through grpclib, never grpcio's C core (mesh/etcd/wire.py), in messages of its own (mesh/etcd/messages.py):
    # no protobuf runtime
    probe = ("import sys, tiermesh.cli.agent, edge_agent.agent; "
             "print(' '.join(sorted(m for m in sys.modules)))")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)
    loaded = set(res.stdout.split())
    assert "edge_agent.agent" in loaded
    for banned in ("onnxruntime", "ai_edge_litert", "tokenizers", "scipy", "sklearn", "networkx", "onnx",
                   "cryptography", "pydantic", "pydantic_settings", "ruamel", "rich", "grpc", "aetcd", "google",
                   "core_scheduler.policy.placement", "core_scheduler.policy.baselines", "prometheus_client"):
        assert not any(m == banned or m.startswith(banned + ".") for m in loaded), banned
