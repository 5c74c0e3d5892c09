"""The CRL follower's pure parts: a StatefulSet member's ordinal, the ``ss`` command line, finding a process by
name in /proc, and the staggered SIGTERM (on a real child process, found through a /proc written here)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from mesh.pki.local import LocalPki
from tiermesh.crl_follow import find_processes, ordinal, signal_process, ss_argv

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("host", "n"), [("etcd-0", 0), ("etcd-2", 2), ("tiermesh-etcd-12", 12), ("etcd", 0),
                                         ("node7.example", 0), ("", 0)])
def test_ordinal_is_the_trailing_integer(host: str, n: int) -> None:
    assert ordinal(host) == n


def test_ss_kills_the_server_side_of_one_port() -> None:
    assert ss_argv(2379) == ["ss", "-K", "-H", "-t", "state", "established", "( sport = :2379 )"]
    for bad in (0, 65536, -1):
        with pytest.raises(ValueError):
            ss_argv(bad)


def _fake_proc(root: Path, pid: int, comm: str, argv0: str) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(argv0.encode() + b"\0--flag\0")


def test_find_processes_by_command_name_or_argv0(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 10, "etcd", "/usr/local/bin/etcd")
    _fake_proc(tmp_path, 11, "python3", "/usr/bin/python3")
    _fake_proc(tmp_path, 12, "setpriv", "etcd")  # argv0 names it
    (tmp_path / "self").mkdir()
    (tmp_path / "13").mkdir()  # gone meanwhile: no comm
    assert find_processes("etcd", tmp_path) == [10, 12]
    assert find_processes("nothing", tmp_path) == []
    assert find_processes("etcd", tmp_path / "missing") == []


async def test_signal_process_waits_its_turn_then_sends_sigterm(tmp_path: Path) -> None:
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    try:
        _fake_proc(tmp_path, child.pid, "fake-etcd", "fake-etcd")
        pki = LocalPki.under(tmp_path / "home")
        pki.init()
        restart = signal_process("fake-etcd", 0.2, hostname="etcd-2", proc=tmp_path)
        started = time.monotonic()
        await restart(pki.crl(), frozenset({1}))
        waited = time.monotonic() - started
        assert 0.55 < waited < 3.0  # 3 x 0.2 s: member 2 goes after members 0 and 1, and member 0 waits too
        assert await asyncio.wait_for(child.wait(), 5) == -15  # SIGTERM
        with pytest.raises(RuntimeError, match="no process named"):
            await signal_process("absent", 0, hostname="etcd-0", proc=tmp_path)(pki.crl(), frozenset())
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()

