"""Run one untrusted piece of work (generating and measuring the variants of an uploaded model) in a child
process that may die, hang or eat memory without taking the variant store with it.

Why a child process and not a thread: a converter fed a hostile model can segfault inside ONNX Runtime,
allocate until the kernel kills whoever is biggest, or loop in C code that no Python timeout interrupts.
Only a process boundary contains all three. The child is a fresh interpreter (``python -m
variant_store.sandbox``, never ``fork``: the store's threads, sockets and event loop are not copied) in its
own session, so one ``killpg`` ends it and anything it started. Before it imports the work's module it
limits itself:

- ``RLIMIT_AS`` (address space; or ``RLIMIT_DATA``, see ``SandboxLimits.memory_rlimit``): an allocation past
  it fails in the child (``MemoryError``, ``std::bad_alloc``, ORT's "Failed to allocate") instead of pushing
  the host into its OOM killer.
- ``RLIMIT_CPU``: the kernel sends ``SIGXCPU`` at the soft limit and ``SIGKILL`` two seconds later.
- ``RLIMIT_CORE`` 0: a crash leaves no core file of someone else's model on the store's disk.
- ``PR_SET_PDEATHSIG``: if the store dies, the kernel kills the child rather than orphan it.

The parent enforces the wall-clock limit (a child blocked in I/O or sleeping uses no CPU) and, whatever
happens, kills the child's process group before returning. A failure raises ``VariantBuildError`` whose
``limit`` detail says which limit was hit: ``memory``, ``cpu``, ``time``, ``crash`` (a signal or exit
code), ``error`` (the work raised) or ``cancelled``; the message ends with the tail of the child's stderr.

The request travels to the child as a pickle written by the parent (trusted). The result comes back as a
pickle written by a process that parsed hostile bytes, so it is read with an unpickler that builds only
the classes named in ``SAFE_RESULT_CLASSES`` (plus what the caller adds): a compromised child cannot make
the parent run code.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import io
import os
import pickle
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.errors import MeshError, VariantBuildError, error_from_code

__all__ = ["SAFE_RESULT_CLASSES", "SandboxLimits", "run_sandboxed", "run_sandboxed_async"]

_MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """What one sandboxed run may use. ``memory_bytes`` is address space (``RLIMIT_AS``), not RSS. Measured on a
    2-core host: the committed cnn-large generates all its variants and is profiled within 512 MiB, and fails
    at 256 MiB. ONNX Runtime and glibc reserve address space per thread, which grows with the core count,
    hence the generous default."""

    memory_bytes: int = 8 << 30
    # "as": RLIMIT_AS, all address space. "data": RLIMIT_DATA, private writable memory only (Linux >= 4.7): for
    # CUDA hosts, whose driver reserves (PROT_NONE) address space far past any useful RLIMIT_AS
    memory_rlimit: str = "as"
    cpu_seconds: int = 600            # CPU time (user + system) of the child
    wall_seconds: float = 900.0       # enforced by the parent: covers a child that sleeps or blocks
    stderr_tail_bytes: int = 4000     # how much of the child's stderr a failure quotes

    def __post_init__(self) -> None:
        if self.memory_bytes < 64 * _MiB or self.cpu_seconds < 1 or self.wall_seconds <= 0:
            raise ValueError(f"sandbox limits too small to start a Python process: {self}")
        if self.memory_rlimit not in ("as", "data"):
            raise ValueError(f"memory_rlimit must be 'as' or 'data', not {self.memory_rlimit!r}")


# Classes a sandboxed result may contain ("module.qualname"); plain containers, str, bytes, int, float, bool
# and None need no entry. numpy arrays come back through numpy's own reconstructors.
SAFE_RESULT_CLASSES: frozenset[str] = frozenset({
    "builtins.complex", "builtins.frozenset", "builtins.set", "builtins.slice", "builtins.range",
    "collections.OrderedDict", "pathlib.Path", "pathlib.PosixPath", "pathlib.PurePosixPath",
    "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct", "numpy.core.multiarray.scalar",
    "numpy._core.multiarray._reconstruct", "numpy._core.multiarray.scalar",
    "variant_store.generate.GeneratedVariant", "variant_store.generate.SkippedVariant",
    "variant_store.profiler.ProfileResult", "variant_store.meta.LatencyStats",
})

_CPU_GRACE_S = 2      # between SIGXCPU (soft limit) and SIGKILL (hard limit)
_EXIT_ERROR = 3       # the work raised: the result file says what
_MEMORY_WORDS = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "Failed to allocate",
                 "out of memory", "failed to map segment")


def run_sandboxed(fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
                  limits: SandboxLimits | None = None, label: str = "",
                  result_classes: Iterable[str] = (), cancel: threading.Event | None = None) -> Any:
    """``fn(*args, **kwargs)`` in a limited child process; its return value, or ``VariantBuildError``.

    ``fn`` must be a module-level function (the child imports it by name); args must pickle. Blocking: call
    it off the event loop (or use ``run_sandboxed_async``). ``result_classes`` names classes the result may
    hold beyond ``SAFE_RESULT_CLASSES``. A ``MeshError`` the work raises comes back as the same class and
    message. Setting ``cancel`` kills the child within a quarter of a second (``limit`` ``cancelled``)."""
    lim = limits or SandboxLimits()
    name = label or f"{fn.__module__}.{fn.__qualname__}"
    if "<" in fn.__qualname__:
        raise VariantBuildError(f"sandbox: {name} is not a module-level function", limit="error")
    with tempfile.TemporaryDirectory(prefix="tiermesh-sandbox-") as tmp:
        req, res, log = Path(tmp, "request.pkl"), Path(tmp, "result.pkl"), Path(tmp, "stderr.log")
        req.write_bytes(pickle.dumps({"module": fn.__module__, "name": fn.__qualname__, "args": tuple(args),
                                      "kwargs": dict(kwargs or {}), "memory": lim.memory_bytes,
                                      "memory_rlimit": lim.memory_rlimit, "cpu": lim.cpu_seconds}))
        started = time.monotonic()
        try:
            with open(log, "wb") as err:
                proc = subprocess.Popen(  # our own interpreter and module, no shell
                    [sys.executable, "-m", "variant_store.sandbox", str(req), str(res)],
                    stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True, close_fds=True)
        except OSError as exc:  # no process, fork refused: this host's trouble, reported as the build's
            raise VariantBuildError(f"{name}: cannot start the sandbox: {exc}", limit="crash") from exc
        try:
            code = _wait(proc, started + lim.wall_seconds, cancel)
            if code is None:
                _kill_group(proc)
                if cancel is not None and cancel.is_set():
                    raise VariantBuildError(f"{name} was cancelled", limit="cancelled")
                raise VariantBuildError(
                    f"{name} ran past its wall-clock limit of {lim.wall_seconds:g} s and was killed"
                    f"{_tail(log, lim)}", limit="time", seconds=lim.wall_seconds)
        finally:
            _kill_group(proc)  # also what the child left behind in its group, and on any exception here
        elapsed = time.monotonic() - started
        if code == 0 and res.is_file():
            return _load_result(res, set(SAFE_RESULT_CLASSES) | set(result_classes), name)
        if code == _EXIT_ERROR and res.is_file():
            raise _child_error(res, name, log, lim)
        raise _classify(code, name, log, lim, elapsed)


async def run_sandboxed_async(fn: Callable[..., Any], args: Iterable[Any] = (),
                              kwargs: Mapping[str, Any] | None = None, *, limits: SandboxLimits | None = None,
                              label: str = "", result_classes: Iterable[str] = ()) -> Any:
    """``run_sandboxed`` from the event loop, in an executor thread. Cancelling the caller kills the child
    (and waits for that) before the ``CancelledError`` goes on: a cancelled build leaves nothing running."""
    cancel = threading.Event()
    work = asyncio.get_running_loop().run_in_executor(
        None, lambda: run_sandboxed(fn, args, kwargs, limits=limits, label=label, result_classes=result_classes,
                                    cancel=cancel))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        cancel.set()
        with contextlib.suppress(Exception):
            await work  # the thread kills and reaps the child within a quarter of a second
        raise


def _wait(proc: subprocess.Popen[bytes], deadline: float, cancel: threading.Event | None) -> int | None:
    """The child's exit status, or ``None`` once the deadline passes or ``cancel`` is set."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or (cancel is not None and cancel.is_set()):
            return None
        try:
            return proc.wait(timeout=min(left, 0.25))
        except subprocess.TimeoutExpired:
            continue


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (its session: the child and whatever it started), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _tail(log: Path, lim: SandboxLimits) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, io.SEEK_END) - lim.stderr_tail_bytes))
            text = f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return f"; child stderr (tail):\n{text}" if text else ""


def _classify(code: int, name: str, log: Path, lim: SandboxLimits, elapsed: float) -> Exception:
    tail = _tail(log, lim)
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and elapsed >= lim.cpu_seconds):
        return VariantBuildError(f"{name} used its CPU-time limit of {lim.cpu_seconds} s and was killed{tail}",
                                 limit="cpu", seconds=lim.cpu_seconds)
    if any(w in tail for w in _MEMORY_WORDS):
        return VariantBuildError(f"{name} ran out of its memory limit of {lim.memory_bytes // _MiB} MiB{tail}",
                                 limit="memory", memory_bytes=lim.memory_bytes, exit_code=code)
    if code < 0:
        try:
            sig = signal.Signals(-code).name
        except ValueError:
            sig = f"signal {-code}"
        return VariantBuildError(f"{name} crashed: killed by {sig}{tail}", limit="crash", signal=sig)
    return VariantBuildError(f"{name} crashed: exit code {code} without a result{tail}", limit="crash",
                             exit_code=code)


def _child_error(res: Path, name: str, log: Path, lim: SandboxLimits) -> Exception:
    try:
        info = _load_result(res, set(), name)
        kind, code, message, trace = (str(info[k]) for k in ("type", "code", "message", "traceback"))
        details = dict(info.get("details") or {})
    except (MeshError, KeyError, TypeError, ValueError, AttributeError):
        return VariantBuildError(f"{name} failed and its error report is unreadable{_tail(log, lim)}",
                                 limit="crash")
    if kind == "MemoryError" or any(w in message for w in _MEMORY_WORDS):  # Python's, or ORT's arena's words
        return VariantBuildError(f"{name} ran out of its memory limit of {lim.memory_bytes // _MiB} MiB "
                                 f"({kind}: {message[:300]}){_tail(log, lim)}", limit="memory",
                                 memory_bytes=lim.memory_bytes)
    if code:  # one of ours: the same class, so a caller's except clauses keep working across the boundary
        err = error_from_code(code, message)
        err.details.update(details)
        if isinstance(getattr(err, "reason", None), str) and isinstance(details.get("reason"), str):
            err.reason = details["reason"]  # type: ignore[attr-defined]  # ModelRejected, PermissionDenied, ...
        err.details.setdefault("limit", "error")
        return err
    tail = trace[-lim.stderr_tail_bytes:]
    return VariantBuildError(f"{name} failed: {kind}: {message}; child traceback (tail):\n{tail}", limit="error",
                             error=kind)


class _ResultUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: set[str]) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" not in self.allowed:
            raise pickle.UnpicklingError(f"class {module}.{name} is not allowed in a sandbox result")
        return super().find_class(module, name)


def _load_result(res: Path, allowed: set[str], name: str) -> Any:
    try:
        return _ResultUnpickler(res.read_bytes(), allowed).load()
    except Exception as exc:  # a hostile child's bytes: anything the unpickler raises is the child's fault
        raise VariantBuildError(f"{name}: unreadable sandbox result: {type(exc).__name__}: {exc}",
                                limit="crash") from exc


# the child --------------------------------------------------------------------------------------

def _limit_self(memory: int, memory_rlimit: str, cpu: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + _CPU_GRACE_S))
    which = resource.RLIMIT_DATA if memory_rlimit == "data" else resource.RLIMIT_AS
    resource.setrlimit(which, (memory, memory))
    with contextlib.suppress(OSError, AttributeError):  # Linux only: die with the parent
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent already died before prctl took effect
            os._exit(1)


def _child(req_path: str, res_path: str) -> int:
    import faulthandler

    faulthandler.enable()  # a segfault in a converter prints the Python stack into the stderr tail
    req = pickle.loads(Path(req_path).read_bytes())  # written by our parent, not the tenant
    _limit_self(int(req["memory"]), str(req["memory_rlimit"]), int(req["cpu"]))
    out: Any
    status = 0
    try:
        fn: Any = importlib.import_module(req["module"])
        for part in req["name"].split("."):
            fn = getattr(fn, part)
        out = fn(*req["args"], **req["kwargs"])
    except BaseException as exc:  # report everything; the parent decides what it means
        status = _EXIT_ERROR
        out = {"type": type(exc).__name__, "code": exc.code if isinstance(exc, MeshError) else "",
               "message": str(getattr(exc, "message", exc)), "traceback": traceback.format_exc(),
               "details": exc.to_dict().get("details", {}) if isinstance(exc, MeshError) else {}}
        traceback.print_exc()
    tmp = res_path + ".part"
    try:
        Path(tmp).write_bytes(pickle.dumps(out))
    except MemoryError:
        print("MemoryError: the result did not fit the sandbox's memory limit", file=sys.stderr)
        return 1
    os.replace(tmp, res_path)  # the parent never reads half a result
    return status


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
