"""The pre-forked agent launcher (tiermesh.launcher): real forks of `tiermesh <argv>`, each its own process, owned,
reaped and ended with its launcher; and what the launcher imports before forking leaves out ONNX Runtime."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiermesh.launcher import PRELOAD, AgentLauncher, ForkedChild

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _until_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def _lingering(tmp: Path) -> list[str]:
    # an agent pointed at a closed port: it retries etcd for seconds before giving up (a child that lives a while)
    return ["agent", "--site", "s", "--etcd", "http://127.0.0.1:9", "--insecure", "--home", str(tmp)]


def test_the_launchers_preload_imports_no_runtime_or_graph_library() -> None:
    probe = (f"import importlib, os, sys\nfor m in {PRELOAD!r}: importlib.import_module(m)\n"
             "print(len(os.listdir('/proc/self/task')), ' '.join(sorted(sys.modules)))")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True, env={**_env(), "OPENBLAS_NUM_THREADS": "1"})
    threads, *loaded = res.stdout.split()
    assert "edge_agent.agent" in loaded
    assert threads == "1"  # what makes forking it safe
    for banned in ("onnxruntime", "onnx", "scipy", "sklearn", "networkx", "tokenizers", "ai_edge_litert", "torch"):
        assert not any(m == banned or m.startswith(banned + ".") for m in loaded), banned


async def test_a_child_runs_the_command_with_its_env_and_log_and_its_exit_is_reported(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    async with AgentLauncher(env=_env()) as launcher:
        assert launcher.pid is not None
        # --probe without a port: a bad-input error (exit 2) printed to stderr, i.e. into the log
        child = await launcher.spawn(["agent", "--site", "s", "--probe", "--home", str(tmp_path)],
                                     env={**_env(), "TIERMESH_LOG_LEVEL": "WARNING"}, log_path=log)
        assert isinstance(child, ForkedChild)
        assert child.pid not in (os.getpid(), launcher.pid)
        assert await asyncio.wait_for(child.wait(), 60) == 2
        assert "--probe needs the agent's --http-port" in log.read_text()
        assert _gone(child.pid)  # reaped by the launcher, not left a zombie
        with pytest.raises(ProcessLookupError):
            child.send_signal(signal.SIGTERM)


async def test_a_signal_to_a_child_is_reported_as_a_negative_returncode(tmp_path: Path) -> None:
    async with AgentLauncher(env=_env()) as launcher:
        child = await launcher.spawn(_lingering(tmp_path), env=_env(), log_path=tmp_path / "a.log")
        child.kill()
        assert await asyncio.wait_for(child.wait(), 30) == -signal.SIGKILL


async def test_stopping_the_launcher_ends_and_reaps_every_child(tmp_path: Path) -> None:
    launcher = AgentLauncher(env=_env())
    await launcher.start()
    try:
        children = [await launcher.spawn(_lingering(tmp_path), env=_env(), log_path=tmp_path / f"{i}.log")
                    for i in range(3)]
        assert len({c.pid for c in children}) == 3
        assert all(not _gone(c.pid) for c in children)
    finally:
        await launcher.stop()
    for c in children:
        assert c.returncode is not None
        assert await _until_gone(c.pid)


async def test_children_die_with_a_launcher_that_is_killed(tmp_path: Path) -> None:
    async with AgentLauncher(env=_env()) as launcher:
        child = await launcher.spawn(_lingering(tmp_path), env=_env(), log_path=tmp_path / "a.log")
        assert launcher.pid is not None
        os.kill(launcher.pid, signal.SIGKILL)
        assert await asyncio.wait_for(child.wait(), 30) == -signal.SIGKILL
        assert await _until_gone(child.pid)  # PR_SET_PDEATHSIG: the kernel ended it
        with pytest.raises(Exception, match="launcher"):
            await launcher.spawn(_lingering(tmp_path), env=_env(), log_path=tmp_path / "b.log")
