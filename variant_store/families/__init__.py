"""Real model families for the mesh's tasks.

``datasets`` (numpy + scikit-learn only) is re-exported here; ``digits`` (training, needs torch) and
``minilm`` (MiniLM export, needs the ``convert`` extra) are scripts imported on demand:
``python -m variant_store.families.digits --out DIR`` and ``python -m variant_store.families.minilm --out DIR``.
"""

from variant_store.families.datasets import (
    CALIB_COUNT,
    DIGITS_DIR,
    SPLIT_SEED,
    DigitsSplit,
    ValidationSet,
    load_digits_manifest,
    load_digits_split,
    load_validation_npz,
    save_validation_npz,
)

__all__ = [
    "CALIB_COUNT",
    "DIGITS_DIR",
    "SPLIT_SEED",
    "DigitsSplit",
    "ValidationSet",
    "load_digits_manifest",
    "load_digits_split",
    "load_validation_npz",
    "save_validation_npz",
]
