"""Module-level functions for ``variant_store.sandbox`` tests: the child imports them by name. Each misbehaves in
one way a converter fed a hostile model can (loop, allocate, crash, leave processes behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from mesh.errors import VariantBuildError

__all__ = ["add", "allocate", "crash", "exit_with", "raise_build_error", "raise_value_error", "sleep_forever",
           "spawn_and_hang", "spin_forever", "unsafe_result"]


def add(a: int, b: int, *, scale: int = 1) -> dict[str, Any]:
    return {"sum": (a + b) * scale, "pid": os.getpid(), "path": Path("/tmp"), "items": [1, 2.5, "x", None]}


def spin_forever() -> None:
    """Burns CPU, as a quantizer that never converges."""
    n = 0
    while True:
        n += 1


def sleep_forever() -> None:
    """Uses no CPU: only the parent's wall clock ends it."""
    while True:
        time.sleep(1)


def allocate(mib: int) -> int:
    """Touches ``mib`` MiB, as a converter materializing a huge declared tensor."""
    block = bytearray(mib << 20)
    return len(block)


def crash() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def exit_with(code: int) -> None:
    os._exit(code)


def raise_value_error() -> None:
    raise ValueError("the converter choked on node 'evil'")


def raise_build_error() -> None:
    raise VariantBuildError("no variant for you")


def spawn_and_hang(pid_file: str) -> None:
    """Starts a grandchild (as a converter shelling out would), records its pid, then hangs."""
    proc = subprocess.Popen(["sleep", "300"])  # a test's grandchild
    Path(pid_file).write_text(str(proc.pid))
    sleep_forever()


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned",))


def unsafe_result() -> Any:
    """A result whose unpickling would run code in the parent."""
    return _Evil()
