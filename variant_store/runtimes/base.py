"""The one model interface: every runtime-backed variant loads, infers and unloads the same way.

``load()`` / ``infer()`` run the blocking work in an executor so an agent's event loop keeps
serving while a model loads or computes; ``load_sync()`` / ``infer_sync()`` are the same work for
callers that already own a thread (profiler, batcher). Inputs are checked against the model's
signature (by the one input check, ``mesh.types.check_inputs``) before they reach the native
runtime, so a wrong shape or dtype is a ``BadTensor`` that names the tensor rather than a crash
deep inside a C++ kernel.
"""

from __future__ import annotations

import asyncio
import os
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import numpy as np

from mesh.errors import RuntimeLoadError
from mesh.types import TensorSpec, check_inputs

__all__ = ["Runtime", "rss_bytes"]


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (0 where that is not readable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Runtime(ABC):
    """A loaded (or loadable) model variant; subclasses implement ``_load`` / ``_run`` / ``_close``."""

    name: ClassVar[str]

    def __init__(self, model_path: Path, *, intra_op_threads: int = 1,
                 providers: list[str] | None = None) -> None:
        self.model_path = Path(model_path)
        self.intra_op_threads = intra_op_threads
        self.requested_providers = list(providers) if providers else None
        self.ready = False
        self.memory_bytes = 0
        self.load_ms = 0.0
        self.providers_in_use: list[str] = []
        self.input_specs: list[TensorSpec] = []
        self.output_specs: list[TensorSpec] = []
        # Loading and unloading must not interleave with a running inference on the same session.
        self._state_lock = threading.Lock()

    # -- blocking API -------------------------------------------------------------------------
    def load_sync(self) -> bool:
        import time

        with self._state_lock:
            if self.ready:
                return True
            if not self.model_path.is_file():
                raise RuntimeLoadError(f"{self.name}: model file not found: {self.model_path}",
                                       path=str(self.model_path))
            self._prime()  # the runtime's process-wide set-up is nobody's variant: not in the measurement
            before = rss_bytes()
            t0 = time.perf_counter()
            self._load()
            self.load_ms = (time.perf_counter() - t0) * 1000.0
            delta = max(0, rss_bytes() - before)
            # The file's bytes are a floor: RSS deltas can hide a load behind memory freed meanwhile.
            self.memory_bytes = max(self.model_path.stat().st_size, delta)
            self.ready = True
            return True

    def infer_sync(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Check ``inputs`` against the signature, then run them (for callers with unchecked inputs)."""
        checked = check_inputs(self.input_specs, inputs)
        if not self.ready:  # run_checked_sync's check, in line: a tiny variant's run is a few calls deep
            raise self._not_loaded()
        return self._run(checked)

    def run_checked_sync(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run inputs that already passed ``mesh.types.check_inputs`` (the serving path: the data
        plane's door checked them once; a batch of checked rows is still checked)."""
        if not self.ready:
            raise self._not_loaded()
        return self._run(inputs)

    def _not_loaded(self) -> RuntimeLoadError:
        return RuntimeLoadError(f"{self.name}: {self.model_path.name} is not loaded")

    def unload_sync(self) -> None:
        with self._state_lock:
            if self.ready:
                self._close()
            self.ready = False
            self.memory_bytes = 0

    # -- asyncio API --------------------------------------------------------------------------
    async def load(self) -> bool:
        return await asyncio.get_running_loop().run_in_executor(None, self.load_sync)

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return await asyncio.get_running_loop().run_in_executor(None, self.infer_sync, inputs)

    async def unload(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.unload_sync)

    # -- implementation hooks -----------------------------------------------------------------
    def _prime(self) -> None:
        """Set up, once per process, what every session of this runtime shares (a CUDA context: ~120 MB
        of host memory that the first variant loaded would otherwise be measured as holding). Idempotent;
        runs before a load's memory is measured. Nothing by default."""
        return None

    @abstractmethod
    def _load(self) -> None:
        """Open the model; set input_specs, output_specs, providers_in_use. Raise RuntimeLoadError."""

    @abstractmethod
    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run checked inputs; return outputs by name, in the dtypes ``output_specs`` declares."""

    def device_memory_bytes(self) -> int:
        """Accelerator memory this variant holds (0 for host-only runtimes); ``memory_bytes`` is host memory."""
        return 0

    @abstractmethod
    def _close(self) -> None:
        """Release the session / interpreter."""

    def __repr__(self) -> str:
        state = "ready" if self.ready else "unloaded"
        return f"<{type(self).__name__} {self.model_path.name} {state} providers={self.providers_in_use}>"
