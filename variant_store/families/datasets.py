"""The digits split every digit-classification model is trained and measured on.

scikit-learn's bundled digits (1797 8x8 images, offline) in the task signature: ``x`` float32
(N, 64) with pixels divided by 16 to [0, 1], ``y`` int64 class 0..9.

The split is fixed (``SPLIT_SEED``) and stratified by class:

    all 1797 ──┬── train       60 %  (1078)   fits the weights
               └── validation  40 %  (719)    never seen in training
                     ├── calib    first 200   INT8 calibration for the variant store
                     └── holdout  the rest    every reported accuracy is measured here (519)

``digits_val.npz`` (committed beside the models) stores the validation part as ``x``, ``y`` and
``calib_count``, calib rows first, so that serving and variant building need neither torch nor a
re-split. Needs no torch: numpy and scikit-learn only.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mesh.errors import CatalogError

__all__ = [
    "CALIB_COUNT",
    "DIGITS_DIR",
    "SPLIT_SEED",
    "TRAIN_FRACTION",
    "DigitsSplit",
    "ValidationSet",
    "load_digits_manifest",
    "load_digits_split",
    "load_validation_npz",
    "save_validation_npz",
]

SPLIT_SEED = 20240611
TRAIN_FRACTION = 0.6
CALIB_COUNT = 200
DIGITS_DIR = Path(__file__).resolve().parent.parent / "models" / "digits"

# A fixed zip timestamp keeps the committed npz byte-identical across rebuilds.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class DigitsSplit:
    x_train: np.ndarray
    y_train: np.ndarray
    x_calib: np.ndarray
    y_calib: np.ndarray
    x_holdout: np.ndarray
    y_holdout: np.ndarray

    @property
    def x_val(self) -> np.ndarray:
        """Validation rows, calib first (the layout of ``digits_val.npz``)."""
        return np.concatenate([self.x_calib, self.x_holdout])

    @property
    def y_val(self) -> np.ndarray:
        return np.concatenate([self.y_calib, self.y_holdout])


@dataclass(frozen=True, slots=True)
class ValidationSet:
    """A labelled validation set whose first ``calib_count`` rows are for calibration only."""

    x: np.ndarray
    y: np.ndarray
    calib_count: int

    @property
    def x_calib(self) -> np.ndarray:
        return self.x[: self.calib_count]

    @property
    def y_calib(self) -> np.ndarray:
        return self.y[: self.calib_count]

    @property
    def x_holdout(self) -> np.ndarray:
        return self.x[self.calib_count:]

    @property
    def y_holdout(self) -> np.ndarray:
        return self.y[self.calib_count:]


def load_digits_split(seed: int = SPLIT_SEED, calib_count: int = CALIB_COUNT) -> DigitsSplit:
    """The documented split, recomputed from scikit-learn's bundled data (deterministic)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (np.asarray(data.data, dtype=np.float32) / 16.0).astype(np.float32)
    y = np.asarray(data.target, dtype=np.int64)
    x_tr, x_val, y_tr, y_val = train_test_split(
        x, y, train_size=TRAIN_FRACTION, stratify=y, random_state=seed)
    # The calib part is stratified too, so INT8 calibration sees every class.
    x_cal, x_hold, y_cal, y_hold = train_test_split(
        x_val, y_val, train_size=calib_count, stratify=y_val, random_state=seed + 1)
    return DigitsSplit(
        x_train=np.ascontiguousarray(x_tr), y_train=np.ascontiguousarray(y_tr),
        x_calib=np.ascontiguousarray(x_cal), y_calib=np.ascontiguousarray(y_cal),
        x_holdout=np.ascontiguousarray(x_hold), y_holdout=np.ascontiguousarray(y_hold),
    )


def save_validation_npz(path: Path, split: DigitsSplit) -> None:
    """Write ``x``, ``y``, ``calib_count`` as a deflated npz with fixed zip timestamps."""
    arrays = {
        "x": split.x_val.astype(np.float32),
        "y": split.y_val.astype(np.int64),
        "calib_count": np.asarray(len(split.y_calib), dtype=np.int64),
    }
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            # Not ascontiguousarray: it would turn the 0-d calib_count into shape (1,).
            np.lib.format.write_array(buf, np.require(arr, requirements="C"), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, buf.getvalue())


def load_validation_npz(path: Path | str | None = None) -> ValidationSet:
    """Load a validation npz (default: the committed digits one)."""
    p = Path(path) if path is not None else DIGITS_DIR / "digits_val.npz"
    try:
        with np.load(p, allow_pickle=False) as npz:
            x = np.asarray(npz["x"], dtype=np.float32)
            y = np.asarray(npz["y"], dtype=np.int64)
            calib = int(np.asarray(npz["calib_count"]).reshape(-1)[0])
    except (OSError, KeyError, ValueError) as exc:
        raise CatalogError(f"cannot read validation set {p}: {exc}", path=str(p)) from exc
    if x.ndim != 2 or len(x) != len(y) or not 0 <= calib <= len(y):
        raise CatalogError(f"malformed validation set {p}", path=str(p))
    return ValidationSet(x=x, y=y, calib_count=calib)


def load_digits_manifest(directory: Path | str | None = None) -> dict[str, Any]:
    """The digits ``manifest.json`` (see ``variant_store/models/README.md`` for its fields)."""
    p = Path(directory if directory is not None else DIGITS_DIR) / "manifest.json"
    try:
        data: dict[str, Any] = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise CatalogError(f"cannot read manifest {p}: {exc}", path=str(p)) from exc
    return data
