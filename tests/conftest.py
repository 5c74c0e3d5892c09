"""Shared fixtures: a session-wide real etcd, a per-test Store under its own prefix, a private etcd
for restart tests, and a check that no test leaves child processes behind."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store

__all__ = ["child_pids"]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: fields start after the last ')'
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def child_pids(parent: int | None = None) -> set[int]:
    """Live (non-zombie) children of ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    pids: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{parent}/task"):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in Path(f"/proc/{parent}/task/{task}/children").read_text().split())
    except OSError:
        pass
    if not pids:  # kernels without /proc/.../children: scan
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _stat(int(name))
                if st and st[1] == parent:
                    pids.add(int(name))
    out = set()
    for pid in pids:
        st = _stat(pid)
        if st is not None and st[0] != "Z" and st[1] == parent:
            out.add(pid)
    return out


@pytest.fixture(autouse=True)
def _no_leaked_children() -> Iterator[None]:
    before = child_pids()
    yield
    deadline = time.monotonic() + 3.0
    leaked = child_pids() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = child_pids() - before
    if leaked:
        names = {}
        for pid in leaked:
            with contextlib.suppress(OSError):
                names[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # so later tests do not inherit it
        pytest.fail(f"test left child processes running: {names}")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EmbeddedEtcd]:
    """One real etcd for the whole session (temp data dir, free ports)."""
    srv = EmbeddedEtcd(unsafe_no_fsync=True)
    srv.start_sync()
    try:
        yield srv
    finally:
        srv.stop_sync()


@pytest.fixture
async def store(etcd_server: EmbeddedEtcd) -> AsyncIterator[Store]:
    """A Store on the session etcd under a prefix no other test uses; its keys are removed after."""
    s = await Store.connect(etcd_server.url, prefix=f"/t-{uuid.uuid4().hex[:12]}/")
    try:
        yield s
    finally:
        with contextlib.suppress(Exception):
            await s.delete_prefix("")
        await s.close()


@pytest.fixture
async def fresh_etcd(tmp_path: Path) -> AsyncIterator[EmbeddedEtcd]:
    """A private etcd (for tests that stop or restart it); stopped even when the test fails."""
    srv = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()
