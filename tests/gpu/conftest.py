"""Fixtures of the GPU tests: the text family, where this host has it (a lent GPU machine gets a packed copy)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def text_family() -> Iterator[Path]:
    from bench.gpu_text import find_text_family, unpacked_family

    d = find_text_family()
    if d is None:
        pytest.skip("the text family is not here: set TIERMESH_TEXT_FAMILY_DIR (python -m bench.gpu_text pack OUT)")
    with unpacked_family(d) as u:
        yield u
