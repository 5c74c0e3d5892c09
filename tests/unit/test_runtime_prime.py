"""A runtime's process-wide set-up (``Runtime._prime``: a CUDA context, say) runs before a load's memory is
measured, so the first variant loaded in a process is not charged for it; and it runs once per load, as the
runtime decides (idempotent there)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from variant_store.runtimes.base import Runtime

pytestmark = pytest.mark.unit

_SHARED: list[bytes] = []  # what "the runtime" keeps for the process (kept alive, pages written)


class _Primed(Runtime):
    name = "primed-test"
    primes = 0

    def _prime(self) -> None:
        type(self).primes += 1
        if not _SHARED:
            _SHARED.append(b"\x01" * (64 << 20))

    def _load(self) -> None:
        self.input_specs = []

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {}

    def _close(self) -> None:
        pass


def test_the_first_load_is_not_charged_the_runtimes_process_wide_set_up(tmp_path: Path) -> None:
    model = tmp_path / "m.bin"
    model.write_bytes(b"\x00" * 1024)
    rt = _Primed(model)
    assert rt.load_sync()
    assert _SHARED and rt.memory_bytes < 16 << 20  # 64 MiB set up before the measurement: not in it
    assert _Primed.primes == 1
    rt.load_sync()  # already loaded: nothing runs again
    assert _Primed.primes == 1
