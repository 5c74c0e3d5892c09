"""EmbeddedEtcd, open_store and `tiermesh etcd` against the real etcd binary."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mesh.errors import EtcdServerError
from mesh.etcd.server import EmbeddedEtcd, find_running, healthy, owner_bound, write_record
from mesh.etcd.store import Store
from tests.conftest import child_pids
from tiermesh.cli.context import open_store

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_start_stop_leaves_no_process_and_removes_temp_dir() -> None:
    srv = EmbeddedEtcd(unsafe_no_fsync=True)
    await srv.start()
    pid, data_dir, url = srv.pid, srv.data_dir, srv.url
    try:
        assert pid is not None and pid in child_pids()
        assert srv.running() and healthy(url) and data_dir.is_dir()
        assert (data_dir / "etcd.log").stat().st_size > 0  # etcd's output goes to the log, not the terminal
        assert not url.endswith(":2379")
    finally:
        await srv.stop()
    assert not srv.running() and not _alive(pid)
    assert not data_dir.exists()
    assert not healthy(url, timeout=0.5)


async def test_restart_on_same_data_dir_keeps_data(tmp_path: Path) -> None:
    async with EmbeddedEtcd(tmp_path / "e", unsafe_no_fsync=True) as srv:
        url = srv.url
        async with await Store.connect(url, "/r/") as s:
            rev = await s.put("k", {"v": 1})
        await srv.restart()
        assert srv.url == url
        async with await Store.connect(srv.url, "/r/") as s:
            got = await s.get("k")
    assert got is not None and got.value == {"v": 1} and got.mod_revision == rev
    # the given data dir is never removed; a new instance with other ports still reads it
    async with EmbeddedEtcd(tmp_path / "e", client_port=_free_port(), peer_port=_free_port()) as srv2:
        assert srv2.url != url
        async with await Store.connect(srv2.url, "/r/") as s:
            assert (await s.get("k")) is not None


async def test_port_in_use_is_an_etcd_server_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        srv = EmbeddedEtcd(tmp_path / "busy", client_port=s.getsockname()[1], start_timeout=10)
        with pytest.raises(EtcdServerError):
            await srv.start()
        assert not srv.running()


async def test_find_running_checks_pid_and_health(tmp_path: Path, etcd_server: EmbeddedEtcd) -> None:
    assert find_running(tmp_path) is None
    assert etcd_server.pid is not None
    write_record(tmp_path, etcd_server.pid, etcd_server.url)
    assert find_running(tmp_path) == etcd_server.url
    write_record(tmp_path, _dead_pid(), etcd_server.url)
    assert find_running(tmp_path) is None


async def test_open_store_starts_temporary_etcd_and_data_persists(tmp_path: Path) -> None:
    before = child_pids()
    async with open_store(home=tmp_path, prefix="/p/") as s:
        assert len(child_pids() - before) == 1
        await s.put("hello", "world")
    assert child_pids() == before, "the temporary etcd must be stopped after the block"
    async with open_store(home=tmp_path, prefix="/p/") as s:
        got = await s.get("hello")
    assert got is not None and got.value == "world"


async def test_open_store_uses_recorded_or_given_etcd(tmp_path: Path, etcd_server: EmbeddedEtcd) -> None:
    assert etcd_server.pid is not None
    write_record(tmp_path, etcd_server.pid, etcd_server.url)
    before = child_pids()
    async with open_store(home=tmp_path, prefix="/q/") as s:
        assert s.url == etcd_server.url
        assert child_pids() == before  # no second etcd started
        await s.delete_prefix("")
    async with open_store(etcd=etcd_server.url, home=tmp_path / "none", prefix="/q/") as s:
        assert s.url == etcd_server.url


def _run_cli_etcd(home: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tiermesh", "etcd", "--home", str(home)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


async def test_cli_etcd_runs_in_foreground_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc = _run_cli_etcd(tmp_path)
    try:
        url = (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)).strip()  # type: ignore[union-attr]
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else url  # type: ignore[union-attr]
        assert find_running(tmp_path) == url
        etcd_pid = json.loads((tmp_path / "etcd.json").read_text())["pid"]
        second = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "tiermesh", "etcd", "--home", str(tmp_path)],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
        assert second.returncode != 0 and "already running" in second.stderr
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(asyncio.to_thread(proc.wait), 20)
        assert code == 0
        assert not (tmp_path / "etcd.json").exists()
        assert not _alive(etcd_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for f in (proc.stdout, proc.stderr):
            if f:
                f.close()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reparented child may wait a while for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not owner_bound(), reason="setpriv (util-linux) is not installed: etcd outlives a killed owner")
def test_etcd_dies_with_an_owner_killed_without_warning(tmp_path: Path) -> None:
    """A process that started etcd and is then SIGKILLed (no stop(), no atexit) takes its etcd with it."""
    code = ("import sys, time; from pathlib import Path; from mesh.etcd.server import EmbeddedEtcd\n"
            "srv = EmbeddedEtcd(Path(sys.argv[1]), unsafe_no_fsync=True); srv.start_sync()\n"
            "print(srv.pid, flush=True); time.sleep(120)\n")
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "etcd")], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True)
    etcd_pid = None
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()  # the owner prints etcd's pid once healthy (it exits in 120 s anyway)
        etcd_pid = int(line)
        assert _running(etcd_pid)
        owner.kill()
        owner.wait(10)
        for _ in range(100):  # bounded: 10 s
            if not _running(etcd_pid):
                break
            time.sleep(0.1)
        assert not _running(etcd_pid), "etcd outlived its SIGKILLed owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        if etcd_pid is not None and _running(etcd_pid):
            os.kill(etcd_pid, signal.SIGKILL)
        if owner.stdout is not None:
            owner.stdout.close()
