"""Triton's classification extension: an output asked for with ``parameters: {"classification": k}`` comes back as
its top ``k`` classes, as BYTES strings ``"value:index:label"`` (``"value:index"`` where the task has no labels),
highest value first, one row of ``k`` strings per batch row. ``value`` is written as C++'s ``std::to_string`` writes
a float (six decimals), as Triton writes it, so a client that splits on ``:`` reads the same thing from both.

``tritonclient``'s ``InferRequestedOutput(name, class_count=k)`` asks for it. Pure functions, no I/O: the codec
(:mod:`mesh.v2.codec`) reads the count, the HTTP front applies :func:`classify` to the data plane's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mesh.errors import BadTensor, RequestError

__all__ = ["MAX_CLASS_COUNT", "class_count", "classify"]

MAX_CLASS_COUNT = 1 << 16  # bounds the strings one request can make the server write


def class_count(value: object, output: str) -> int:
    """The ``classification`` parameter of requested ``output``, checked: an integer from 1 to MAX_CLASS_COUNT."""
    if type(value) is not int or not 1 <= value <= MAX_CLASS_COUNT:
        raise RequestError(f"output {output!r}: classification must be an integer from 1 to {MAX_CLASS_COUNT}, "
                           f"got {value!r}")
    return value


def classify(arr: np.ndarray, k: int, labels: Sequence[str] | None, name: str = "output") -> np.ndarray:
    """The top ``k`` classes of ``arr`` (shape ``(classes,)``, or ``(rows, classes...)`` whose trailing dimensions
    are one row's classes) as an object array of bytes, shape ``(k,)`` or ``(rows, k)``. ``k`` above the number of
    classes is cut to it, as Triton does; a label beyond ``labels`` is left out (``value:index``)."""
    if arr.dtype.kind not in "fiub":
        raise BadTensor(f"output {name!r} of datatype {arr.dtype} cannot be classified: it holds no class scores")
    if arr.ndim == 0:
        raise BadTensor(f"output {name!r} is a scalar: it holds no classes to rank")
    rows = arr.reshape(1, -1) if arr.ndim == 1 else arr.reshape(arr.shape[0], -1)
    k = min(k, rows.shape[1])
    # a stable sort of the negated scores: ties keep the lower index first, as std::stable_sort does in Triton
    top = np.argsort(-rows.astype(np.float64, copy=False), axis=1, kind="stable")[:, :k]
    out = np.empty((rows.shape[0], k), dtype=object)
    n_labels = len(labels) if labels is not None else 0
    for r in range(rows.shape[0]):
        row = rows[r]
        for c, idx in enumerate(top[r].tolist()):
            text = f"{float(row[idx]):f}:{idx}"
            if idx < n_labels:
                text += f":{labels[idx]}"  # type: ignore[index]
            out[r, c] = text.encode()
    return out.reshape(k) if arr.ndim == 1 else out
