"""A pre-forked launcher for site agents: one process imports the agent's code once, then forks one child per site.

``tiermesh up`` starts 20 agents on a machine with two cores. As separate interpreters each of them imports the
agent (aiohttp, numpy, zmq, the etcd client, ...: about 0.6 s of CPU) before doing anything, so 20 of them queue
for ~12 s of CPU. Forked from a launcher that imported all that once, a child starts with it already in memory
(copy-on-write, so the pages stay shared as long as nobody writes them, which also lowers each agent's PSS).

Each child is still a process of its own with its own pid (signals, ``/proc``, a cgroup per site all work on it),
running ``tiermesh <argv>`` exactly as ``python -m tiermesh <argv>`` would, with the environment and log file its
spawner gave it. The launcher owns and reaps its children; the spawner (:class:`AgentLauncher`) owns the launcher.

Fork safety: the launcher forks before any thread, event loop, etcd channel or ZeroMQ context exists in it (it only
imports modules and reads its pipe); ONNX Runtime is not imported here (agents import it when they load their
first variant), OpenBLAS is kept to the calling thread, and :func:`_serve` checks the process has one thread
before every fork.

The protocol is JSON lines. Spawner -> launcher on stdin: ``{"spawn": id, "argv": [...], "env": {...},
"log": path}``. Launcher -> spawner on stdout: ``{"ready": pid}`` once, ``{"spawned": id, "pid": pid}`` (or
``{"spawned": id, "error": why}``), and ``{"exited": pid, "rc": rc}`` for each child it reaped (``rc`` as
``Popen.returncode``: negative for a signal). EOF on stdin: SIGTERM to every child, SIGKILL to those still there
after :data:`STOP_GRACE_S`, then exit. Each child also gets SIGKILL from the kernel if the launcher dies
(``PR_SET_PDEATHSIG``), so no agent outlives its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mesh.errors import MeshError
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger

__all__ = ["PRELOAD", "STOP_GRACE_S", "AgentLauncher", "ForkedChild"]

log = get_logger(__name__)
# the command line a child runs, named as `python -m tiermesh` finds it (by name, as the interpreter does: the CLI
# stands above the harness that owns this launcher)
ENTRY = "tiermesh.cli.main"
# what a child would import first anyway: `tiermesh agent`'s command module and what it imports
PRELOAD = (ENTRY, "tiermesh.cli.agent", "mesh.settings")
STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1
# OpenBLAS (numpy) starts a worker thread per extra core at import; with one it starts none, so the launcher
# really is single-threaded when it forks. Agents do no BLAS-heavy work (inference is ONNX Runtime's).
_LAUNCHER_ENV = {"OPENBLAS_NUM_THREADS": "1"}


# -- the launcher process ----------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _rc(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(argv: list[str], env: dict[str, str], log_path: str, launcher_pid: int, cgroup_procs: str | None) -> None:
    """In the forked child: join ``cgroup_procs``'s cgroup (if any), become ``tiermesh <argv>``, never return."""
    rc = 1
    try:
        _die_with_parent()
        if os.getppid() != launcher_pid:  # the launcher died between fork and prctl
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        if cgroup_procs:  # before any thread exists and any work is done: all of it runs under the cap
            with open(cgroup_procs, "w", encoding="ascii") as fh:
                fh.write(str(os.getpid()))
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["tiermesh", *argv]
        rc = importlib.import_module(ENTRY).main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the child must end in os._exit whatever happened
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(rc)


def _serve() -> int:
    """The launcher's loop (``python -m tiermesh.launcher``): spawn on request, reap, report."""
    _die_with_parent()
    for name in PRELOAD:
        importlib.import_module(name)
    # what the imports made lives as long as every child: into the permanent generation, so no child's collector
    # walks (and copies, page by page) the heap it inherited (the gc module's advice for pre-fork servers)
    gc.collect()
    gc.freeze()
    out = sys.stdout

    def say(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of it
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a Ctrl-C is for the spawner; EOF on stdin stops us
    children: set[int] = set()

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            say({"exited": pid, "rc": _rc(status)})

    sel = selectors.DefaultSelector()
    stdin = sys.stdin.buffer
    sel.register(stdin.fileno(), selectors.EVENT_READ, "in")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    say({"ready": os.getpid()})
    buf = b""
    eof = False
    while not eof:
        for key, _ in sel.select():
            if key.data == "wake":
                os.read(wake_r, 4096)
                reap()
                continue
            chunk = os.read(stdin.fileno(), 65536)
            if not chunk:
                eof = True
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                if len(os.listdir("/proc/self/task")) != 1:
                    say({"spawned": req["spawn"], "error": "launcher is not single-threaded: refusing to fork"})
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _child(list(req["argv"]), dict(req["env"]), str(req["log"]), os.getppid(), req.get("cgroup"))
                children.add(pid)
                say({"spawned": req["spawn"], "pid": pid})
        reap()
    # stdin closed: our owner is done (or gone); so are the children
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while children and time.monotonic() < deadline:
        reap()
        time.sleep(0.05)
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while children:
        pid, status = os.waitpid(-1, 0)
        children.discard(pid)
        with contextlib.suppress(OSError):
            say({"exited": pid, "rc": _rc(status)})
    return 0


# -- the spawner's side ------------------------------------------------------------------------------------------
class ForkedChild:
    """A launcher's child as its spawner sees it: the parts of ``asyncio.subprocess.Process`` the harness uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.Event()

    def _set_exit(self, rc: int) -> None:
        if self.returncode is None:
            self.returncode = rc
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:  # reaped: the pid may be someone else's by now
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedChild pid={self.pid} returncode={self.returncode}>"


class AgentLauncher(Service):
    """Owns one launcher process; :meth:`spawn` forks a child of it running ``tiermesh <argv>``.
    Stopping it ends every child (SIGTERM, then SIGKILL) and the launcher."""

    def __init__(self, *, env: dict[str, str] | None = None, startup_timeout_s: float = 60.0) -> None:
        self._env = env
        self._timeout = startup_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._children: dict[int, ForkedChild] = {}
        self._pending: dict[int, asyncio.Future[ForkedChild]] = {}
        self._next = 0
        self._ready: asyncio.Future[int] | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def _start(self) -> None:
        self._ready = asyncio.get_running_loop().create_future()
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tiermesh.launcher", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env={**(os.environ if self._env is None else self._env), **_LAUNCHER_ENV})
        self._reader = asyncio.create_task(self._read(), name="launcher-read")
        try:
            async with asyncio.timeout(self._timeout):
                await asyncio.shield(self._ready)
        except TimeoutError as exc:
            raise MeshError(f"the agent launcher did not start in {self._timeout:.0f} s") from exc

    async def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            async for raw in self._proc.stdout:
                msg = json.loads(raw)
                if "ready" in msg and self._ready is not None and not self._ready.done():
                    self._ready.set_result(int(msg["ready"]))
                elif "spawned" in msg:
                    fut = self._pending.pop(int(msg["spawned"]), None)
                    if fut is not None and not fut.done():
                        if "pid" in msg:  # registered before the next line, which may be its exit, is read
                            child = self._children[int(msg["pid"])] = ForkedChild(int(msg["pid"]))
                            fut.set_result(child)
                        else:
                            fut.set_exception(MeshError(f"agent launcher: {msg.get('error')}"))
                elif "exited" in msg:
                    gone = self._children.pop(int(msg["exited"]), None)
                    if gone is not None:
                        gone._set_exit(int(msg["rc"]))
        finally:
            # the launcher is gone: its children went with it (PR_SET_PDEATHSIG)
            for child in self._children.values():
                child._set_exit(-signal.SIGKILL)
            self._children.clear()
            waiting: list[asyncio.Future[Any]] = [*self._pending.values()]
            if self._ready is not None:
                waiting.append(self._ready)
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(MeshError("the agent launcher exited"))
            self._pending.clear()

    async def spawn(self, argv: Sequence[str], *, env: dict[str, str], log_path: Path,
                    cgroup_procs: Path | None = None) -> ForkedChild:
        """Fork a child running ``tiermesh <argv>`` with exactly ``env``, stdout and stderr appended to
        ``log_path``; with ``cgroup_procs`` the child first writes its pid there (joins that cgroup)."""
        if self._proc is None or self._proc.stdin is None or self._proc.returncode is not None:
            raise MeshError("the agent launcher is not running")
        async with self._lock:  # one request in flight: a child is registered before its exit can be read
            self._next += 1
            fut: asyncio.Future[ForkedChild] = asyncio.get_running_loop().create_future()
            self._pending[self._next] = fut
            self._proc.stdin.write(json.dumps({"spawn": self._next, "argv": list(argv), "env": env,
                                               "log": str(log_path),
                                               "cgroup": str(cgroup_procs) if cgroup_procs else None}).encode()
                                   + b"\n")
            await self._proc.stdin.drain()
            async with asyncio.timeout(self._timeout):
                return await fut

    async def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            async with asyncio.timeout(STOP_GRACE_S + 10.0):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        finally:
            if self._reader is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(5.0):
                        await asyncio.shield(self._reader)
                await cancel_and_wait(self._reader)


if __name__ == "__main__":
    sys.exit(_serve())
