"""The fixed digits split: deterministic, stratified, documented sizes, disjoint parts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from variant_store.families.datasets import (
    CALIB_COUNT,
    DigitsSplit,
    load_digits_split,
    load_validation_npz,
    save_validation_npz,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def split() -> DigitsSplit:
    return load_digits_split()


def _rows(x: np.ndarray) -> set[bytes]:
    return {r.tobytes() for r in x}


def test_sizes_match_documentation(split: DigitsSplit) -> None:
    assert len(split.y_train) == 1078
    assert len(split.y_calib) == CALIB_COUNT == 200
    assert len(split.y_holdout) == 519
    assert len(split.y_train) + len(split.y_calib) + len(split.y_holdout) == 1797
    for x, y in ((split.x_train, split.y_train), (split.x_calib, split.y_calib),
                 (split.x_holdout, split.y_holdout)):
        assert x.dtype == np.float32 and x.shape == (len(y), 64)
        assert y.dtype == np.int64
        assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0


def test_split_is_deterministic(split: DigitsSplit) -> None:
    again = load_digits_split()
    for name in ("x_train", "y_train", "x_calib", "y_calib", "x_holdout", "y_holdout"):
        np.testing.assert_array_equal(getattr(split, name), getattr(again, name))
    other = load_digits_split(seed=1)
    assert not np.array_equal(split.y_train, other.y_train)


def test_split_is_stratified(split: DigitsSplit) -> None:
    whole = np.bincount(np.concatenate([split.y_train, split.y_val]), minlength=10) / 1797
    for y in (split.y_train, split.y_calib, split.y_holdout):
        counts = np.bincount(y, minlength=10)
        assert counts.min() > 0, "every class appears in every part"
        # Stratification keeps each class share within one sample of the overall share.
        assert np.all(np.abs(counts - whole * len(y)) <= 1.0 + 1e-9)


def test_parts_are_disjoint(split: DigitsSplit) -> None:
    # sklearn's digits holds no two identical images, so row identity is sample identity.
    train, calib, hold = _rows(split.x_train), _rows(split.x_calib), _rows(split.x_holdout)
    assert len(train) + len(calib) + len(hold) == 1797
    assert not train & calib and not train & hold and not calib & hold


def test_npz_roundtrip_keeps_calib_first(split: DigitsSplit, tmp_path: Path) -> None:
    path = tmp_path / "val.npz"
    save_validation_npz(path, split)
    first = path.read_bytes()
    save_validation_npz(path, split)
    assert path.read_bytes() == first, "rewriting the npz is byte-identical"
    assert len(first) < 200_000
    val = load_validation_npz(path)
    assert val.calib_count == CALIB_COUNT
    np.testing.assert_array_equal(val.x_calib, split.x_calib)
    np.testing.assert_array_equal(val.y_holdout, split.y_holdout)
    np.testing.assert_array_equal(val.x_holdout, split.x_holdout)


def test_committed_npz_is_this_split(split: DigitsSplit) -> None:
    val = load_validation_npz()
    np.testing.assert_array_equal(val.x, split.x_val)
    np.testing.assert_array_equal(val.y, split.y_val)
    assert val.calib_count == len(split.y_calib)
