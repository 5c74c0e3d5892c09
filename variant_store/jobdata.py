"""Offline jobs' input and output files: parsing a tenant's rows (NPZ, JSON lines or the OIP binary layout) and
writing a chunk's outputs.

Input formats (``mesh.jobspec.InputFormat``):

- ``npz``: a NumPy ``.npz`` holding an array ``x`` (rows along axis 0, a numeric dtype; no pickles);
- ``jsonl``: one row per line, each either a JSON list of numbers (every row the same length) or a JSON string (a
  text row); an empty last line is allowed, nothing else empty;
- ``oip``: the Open Inference Protocol's binary tensor layout (a JSON header, then the raw tensor bytes), one input
  whose first dimension is the rows: numeric, or ``BYTES`` for text (``variant_store.jobdata_oip``).

Every error is a ``RequestError`` naming the line (JSON lines), the array (NPZ) or the field, byte or row (OIP): a
tenant's file is hostile input.

Output of a chunk: an NPZ with one array per output tensor (named as the variant names them), rows in input order.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mesh.errors import RequestError
from mesh.jobspec import InputFormat
from variant_store.jobdata_oip import oip_rows, oip_scan

__all__ = ["MAX_LINE", "InputSummary", "decode_outputs", "encode_outputs", "read_rows", "scan_input"]

MAX_LINE = 1 << 20  # one JSON row; a longer line is refused rather than read whole into memory


@dataclass(frozen=True, slots=True)
class InputSummary:
    """What a checked input holds: ``rows``, their ``kind`` ("numbers" or "text") and ``width`` (numbers per
    row, 0 for text)."""

    rows: int
    kind: str
    width: int


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        lineno = 0
        while True:
            raw = f.readline(MAX_LINE + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
                raise RequestError(f"line {lineno}: longer than {MAX_LINE} bytes", line=lineno)
            yield lineno, raw


def _row(lineno: int, raw: bytes) -> list[float] | str:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RequestError(f"line {lineno}: not JSON ({str(exc)[:120]})", line=lineno) from exc
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        if not all(math.isfinite(v) for v in value):
            raise RequestError(f"line {lineno}: a row holds NaN or infinity", line=lineno)
        return value
    raise RequestError(f"line {lineno}: a row is a non-empty list of numbers or a string, got "
                       f"{type(value).__name__}", line=lineno)


def _npz_x(path: Path) -> np.ndarray:
    try:
        with np.load(path, allow_pickle=False) as npz:
            if "x" not in npz.files:
                raise RequestError(f"the NPZ holds no array 'x' (it holds {', '.join(npz.files[:8]) or 'nothing'})")
            x = npz["x"]
    except RequestError:
        raise
    except Exception as exc:  # a hostile zip raises many kinds (BadZipFile, ValueError, OSError, EOFError...)
        raise RequestError(f"not a readable NPZ: {type(exc).__name__}: {str(exc)[:160]}") from exc
    if x.ndim < 1 or x.shape[0] < 1:
        raise RequestError(f"array 'x' needs rows along its first axis, has shape {x.shape}")
    if x.dtype.kind not in "fiu":
        raise RequestError(f"array 'x' must be numeric, is {x.dtype}")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        bad = int(np.argwhere(~np.isfinite(x.reshape(len(x), -1)))[0][0])
        raise RequestError(f"array 'x' row {bad}: NaN or infinity", row=bad)
    return x


def scan_input(path: Path, fmt: InputFormat, header_length: int | None = None) -> InputSummary:
    """Check a whole input file and count its rows (JSON lines and OIP: streamed, one line or block of rows in
    memory at a time). ``header_length``: OIP's ``Inference-Header-Content-Length``, when the caller sent it."""
    if fmt == "oip":
        layout = oip_scan(path, header_length)
        return InputSummary(layout.rows, "text" if layout.datatype == "BYTES" else "numbers", layout.width)
    if fmt == "npz":
        x = _npz_x(path)
        return InputSummary(int(x.shape[0]), "numbers", int(np.prod(x.shape[1:], dtype=np.int64)))
    rows, kind, width = 0, "", 0
    last_empty = False
    for lineno, raw in _lines(path):
        if last_empty:
            raise RequestError(f"line {lineno - 1}: empty line", line=lineno - 1)
        if not raw.strip():
            last_empty = True
            continue
        row = _row(lineno, raw)
        this = "text" if isinstance(row, str) else "numbers"
        if not kind:
            kind, width = this, (0 if isinstance(row, str) else len(row))
        elif this != kind:
            raise RequestError(f"line {lineno}: a {this} row among {kind} rows", line=lineno)
        elif not isinstance(row, str) and len(row) != width:
            raise RequestError(f"line {lineno}: {len(row)} numbers, the rows before have {width}", line=lineno)
        rows += 1
    if rows == 0:
        raise RequestError("the input holds no rows")
    return InputSummary(rows, kind, width)


def read_rows(path: Path, fmt: InputFormat, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of a checked input: float32 for numbers (NPZ rows keep their shape), an object array
    of ``str`` for text."""
    if fmt == "oip":
        return oip_rows(path, start, stop)
    if fmt == "npz":
        x = _npz_x(path)
        if stop > len(x):
            raise RequestError(f"rows {start}..{stop} past the input's {len(x)} rows")
        return np.ascontiguousarray(x[start:stop], dtype=np.float32)
    out: list[Any] = []
    i = 0
    for lineno, raw in _lines(path):
        if not raw.strip():
            continue
        if i >= stop:
            break
        if i >= start:
            out.append(_row(lineno, raw))
        i += 1
    if len(out) != stop - start:
        raise RequestError(f"rows {start}..{stop} past the input's {i} rows")
    if isinstance(out[0], str):
        return np.array(out, dtype=object)
    return np.asarray(out, dtype=np.float32)


def encode_outputs(outputs: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **outputs)  # type: ignore[arg-type]  # numpy stubs type **kwds by allow_pickle
    return buf.getvalue()


def decode_outputs(data: bytes) -> dict[str, np.ndarray]:
    """A chunk's outputs (written by a site: decoded as hostile too)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as exc:
        raise RequestError(f"a chunk's outputs are not a readable NPZ: {exc}") from exc
