"""An offline job's input in the Open Inference Protocol's binary tensor layout, read from the file on disk.

The layout is what ``tritonclient.http`` sends (KServe V2 binary tensor extension): a JSON header, then each input's
raw bytes in the order the header lists them, each input naming its byte count in ``parameters.binary_data_size``.
Over HTTP the header's length rides in ``Inference-Header-Content-Length``; a file on disk has no HTTP header, so
the length is what the sizes leave: ``header = file size - sum(binary_data_size)``. That is exact (unlike reading
where the JSON ends, which cannot tell trailing whitespace from tensor bytes that happen to be spaces), and the
door cross-checks it against the HTTP header when the caller sent one.

A job's input is one tensor; its rows are the first dimension. Numeric datatypes are read as NumPy little-endian
arrays (rows ``[start, stop)`` by a seek: nothing else is read). ``BYTES`` (text rows, shape ``[N]`` or ``[N, 1]``)
is the protocol's 4-byte little-endian length then the bytes, element after element: a row range is found by
walking the length prefixes from the start (streamed, one element in memory at a time).

Every problem is a ``RequestError`` that names it (the field, the byte offset or the row): the file is hostile.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from mesh.errors import RequestError

__all__ = ["MAX_ELEMENT", "MAX_HEADER", "NUMERIC", "OipLayout", "oip_layout", "oip_rows", "oip_scan"]

MAX_HEADER = 1 << 20    # bytes of JSON header: one input's is a few hundred
MAX_ELEMENT = 1 << 20   # one BYTES element, as one JSON line (variant_store.jobdata.MAX_LINE)
# OIP datatype -> NumPy dtype (little-endian, as the protocol sends); BOOL and BF16 are not model rows here
NUMERIC: dict[str, str] = {"UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "<i1",
                           "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4",
                           "FP64": "<f8"}
_BLOCK_ROWS_BYTES = 8 << 20  # how much of the tensor one step of the whole-file check reads
_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class OipLayout:
    """Where the single input's bytes are: ``offset`` (= the header's length), ``size``; its ``datatype`` and
    ``shape`` (rows first)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    offset: int
    size: int

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def width(self) -> int:
        """Values per row (0 for text)."""
        return 0 if self.datatype == "BYTES" else int(math.prod(self.shape[1:]))

    @property
    def row_bytes(self) -> int:
        return self.width * np.dtype(NUMERIC[self.datatype]).itemsize


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40 for v in value):
        raise RequestError(f"{what} must be a non-empty list of whole numbers >= 0, got {str(value)[:80]}")
    return tuple(value)


def oip_layout(path: Path, header_length: int | None = None) -> OipLayout:
    """The input's layout, every field of the header checked against the file's size. ``header_length``: the
    ``Inference-Header-Content-Length`` the caller sent, when it sent one (must agree)."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(min(file_size, MAX_HEADER))
    # latin-1 maps byte i to character i: raw_decode's end is the header's byte count, whatever follows it
    try:
        header, end = json.JSONDecoder().raw_decode(head.decode("latin-1"))
    except (ValueError, RecursionError) as exc:
        more = f" within its first {MAX_HEADER} bytes" if file_size > MAX_HEADER else ""
        raise RequestError(f"OIP header: no JSON object at the start of the file{more} ({str(exc)[:100]})") from exc
    try:
        header = json.loads(head[:end].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RequestError(f"OIP header: not UTF-8 JSON ({str(exc)[:100]})") from exc
    if not isinstance(header, dict):
        raise RequestError(f"OIP header: a JSON object, not {type(header).__name__}")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        n = len(inputs) if isinstance(inputs, list) else "no"
        raise RequestError(f"OIP header: 'inputs' must list exactly one tensor (a job's rows), it has {n}")
    inp = inputs[0]
    name = inp.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("OIP header: inputs[0] has no 'name'")
    dt = inp.get("datatype")
    if dt != "BYTES" and dt not in NUMERIC:
        raise RequestError(f"OIP input {name[:40]!r}: datatype {str(dt)[:20]!r} is not one of BYTES, "
                           f"{', '.join(NUMERIC)}")
    shape = _int_list(inp.get("shape"), f"OIP input {name[:40]!r}: shape")
    if shape[0] < 1:
        raise RequestError(f"OIP input {name[:40]!r}: shape {list(shape)} has no rows (its first dimension)")
    if dt == "BYTES" and not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
        raise RequestError(f"OIP input {name[:40]!r}: BYTES rows are one text each: shape [N] or [N, 1], "
                           f"got {list(shape)}")
    if "data" in inp:
        raise RequestError(f"OIP input {name[:40]!r}: carries JSON 'data'; a job takes the binary layout "
                           "(parameters.binary_data_size) or format=jsonl")
    params = inp.get("parameters")
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise RequestError(f"OIP input {name[:40]!r}: parameters.binary_data_size must be a whole number of "
                           f"bytes, got {str(size)[:40]}")
    if dt in NUMERIC:
        want = math.prod(shape) * np.dtype(NUMERIC[dt]).itemsize
        if size != want:
            raise RequestError(f"OIP input {name[:40]!r}: binary_data_size is {size} bytes, but shape "
                               f"{list(shape)} of {dt} is {want}")
    offset = file_size - size
    if offset < end:
        raise RequestError(f"OIP input {name[:40]!r}: binary_data_size {size} does not fit the file: "
                           f"{file_size} bytes, {end} of them the JSON header (truncated?)")
    if offset > len(head) or head[end:offset].strip(b" \t\r\n"):
        raise RequestError(f"the file holds {offset - end} bytes more than its JSON header ({end} bytes) and "
                           f"binary_data_size ({size}) account for")
    if header_length is not None and header_length != offset:
        raise RequestError(f"Inference-Header-Content-Length says {header_length}, but the header is {offset} bytes "
                           f"(the file's {file_size} less binary_data_size {size})")
    return OipLayout(name, dt, shape, offset, size)


def _elements(f: IO[bytes], layout: OipLayout) -> Iterator[bytes]:
    """The BYTES elements in order, each checked against what is left of the tensor."""
    f.seek(layout.offset)
    left = layout.size
    for i in range(layout.rows):
        if left < _LEN.size:
            raise RequestError(f"OIP input {layout.name!r}: BYTES element {i}: the tensor ends (truncated?)", row=i)
        (n,) = _LEN.unpack(f.read(_LEN.size))
        left -= _LEN.size
        if n > MAX_ELEMENT:
            raise RequestError(f"OIP input {layout.name!r}: BYTES element {i} is {n} bytes, over {MAX_ELEMENT}",
                               row=i)
        if n > left:
            raise RequestError(f"OIP input {layout.name!r}: BYTES element {i} claims {n} bytes, {left} are left",
                               row=i)
        left -= n
        yield f.read(n)
    if left:
        raise RequestError(f"OIP input {layout.name!r}: {left} bytes after its {layout.rows} BYTES elements")


def oip_scan(path: Path, header_length: int | None = None) -> OipLayout:
    """Check the whole file (the header, then every row: no NaN or infinity, BYTES well framed), one block of
    rows in memory at a time."""
    layout = oip_layout(path, header_length)
    with open(path, "rb") as f:
        if layout.datatype == "BYTES":
            for _ in _elements(f, layout):
                pass
            return layout
        if layout.datatype.startswith("FP") and layout.width:
            step = max(1, _BLOCK_ROWS_BYTES // max(1, layout.row_bytes))
            for lo in range(0, layout.rows, step):
                block = _numeric(f, layout, lo, min(layout.rows, lo + step))
                bad = ~np.isfinite(block.reshape(len(block), -1)).all(axis=1)
                if bad.any():
                    row = lo + int(np.argmax(bad))
                    raise RequestError(f"OIP input {layout.name!r} row {row}: NaN or infinity", row=row)
    return layout


def _numeric(f: IO[bytes], layout: OipLayout, start: int, stop: int) -> np.ndarray:
    f.seek(layout.offset + start * layout.row_bytes, os.SEEK_SET)
    raw = f.read((stop - start) * layout.row_bytes)
    if len(raw) != (stop - start) * layout.row_bytes:
        raise RequestError(f"OIP input {layout.name!r}: rows {start}..{stop} run past the end of the file")
    return np.frombuffer(raw, dtype=NUMERIC[layout.datatype]).reshape((stop - start, *layout.shape[1:]))


def oip_rows(path: Path, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of a checked file: float32 for numbers (rows keep their shape), an object array of
    ``str`` for text (UTF-8, invalid bytes replaced: as the text runtime reads them)."""
    layout = oip_layout(path)
    if not 0 <= start < stop <= layout.rows:
        raise RequestError(f"rows {start}..{stop} past the input's {layout.rows} rows")
    with open(path, "rb") as f:
        if layout.datatype != "BYTES":
            return np.ascontiguousarray(_numeric(f, layout, start, stop), dtype=np.float32)
        out: list[str] = []
        for i, raw in enumerate(_elements(f, layout)):
            if i >= stop:
                break
            if i >= start:
                out.append(raw.decode("utf-8", errors="replace"))
        return np.array(out, dtype=object)
