"""Tensors without numpy, for the SDK's base install: :class:`Tensor`, and the Open Inference Protocol codec the
SDK needs (an infer request out, an infer response in) over it.

A device that only calls the mesh need not carry numpy (about 70 MB installed). Where numpy is importable the SDK
keeps sending and returning numpy arrays (:mod:`mesh.v2.codec`); without it, it sends what a caller has (nested
lists, ``array.array``, lists of ``str``/``bytes`` for a BYTES tensor, or a :class:`Tensor`) and returns
:class:`Tensor` objects. Both write the same bytes for the same values (``tests/unit/test_plain_tensors.py``): the
layout is :mod:`mesh.v2.body`, the datatypes :mod:`mesh.v2.datatypes`, the BYTES form :mod:`mesh.bytes_tensor`.

A :class:`Tensor`'s ``data`` is flat, in C order: an ``array.array`` of the datatype for numbers (a buffer, in
this machine's byte order), a list of ``bool`` for BOOL, of ``float`` for FP16 (``array`` has no half floats),
of ``bytes`` for BYTES. ``numpy.asarray(t)`` gives the ndarray numpy's codec would have returned.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mesh.bytes_tensor import as_items, pack_items, unpack_items
from mesh.errors import BadTensor
from mesh.v2.body import DecodedResponse, assemble, request_head, response_meta, split_body
from mesh.v2.datatypes import BYTES, FIXED, ITEMSIZE, check_datatype

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Tensor", "as_tensor", "decode_infer_response", "encode_infer_request", "fit_shape", "tensor_data"]

# array.array codes for the datatypes it holds at their wire size (BOOL and FP16 are lists: see the docstring)
_CODES: dict[str, str] = {v2: fmt for v2, (fmt, _) in FIXED.items()
                          if fmt in "bBhHiIqQfd" and array(fmt).itemsize == ITEMSIZE[v2]}
_SWAP = sys.byteorder != "little"  # the wire is little-endian
Data = array | list  # type: ignore[type-arg]
_NESTED = (list, tuple, array)


class Tensor:
    """A tensor as the SDK's base install returns it: ``datatype`` (a V2 name such as ``"FP32"``), ``shape``
    and flat C-order ``data`` (module docstring). ``tolist()`` nests it; ``numpy.asarray(t)`` makes an ndarray."""

    __slots__ = ("data", "datatype", "shape")

    def __init__(self, datatype: str, shape: Sequence[int], data: Data) -> None:
        self.datatype = check_datatype(datatype)
        self.shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in self.shape):
            raise BadTensor(f"shape {list(self.shape)} has a negative dimension")
        if len(data) != math.prod(self.shape):
            raise BadTensor(f"{len(data)} elements cannot fill shape {list(self.shape)}")
        code = _CODES.get(self.datatype)
        if code is not None and not (isinstance(data, array) and data.typecode == code):
            raise BadTensor(f"{self.datatype} data must be an array.array('{code}'), got {type(data).__name__}")
        if code is None and not isinstance(data, list):
            raise BadTensor(f"{self.datatype} data must be a list, got {type(data).__name__}")
        self.data = data

    @classmethod
    def from_wire(cls, datatype: str, shape: tuple[int, ...], raw: bytes | memoryview,
                  where: str = "tensor") -> Tensor:
        """The tensor whose binary-extension bytes are ``raw``; ``BadTensor`` if their size does not fit."""
        count = math.prod(shape)
        if datatype == BYTES:
            return cls(datatype, shape, unpack_items(raw, count, where))
        size = count * ITEMSIZE[datatype]
        if len(raw) != size:
            raise BadTensor(f"{where}: binary_data_size is {len(raw)} bytes but shape {list(shape)} "
                            f"of {datatype} needs {size}")
        code = _CODES.get(datatype)
        data: Data
        if code is not None:
            data = array(code)
            data.frombytes(raw)
            if _SWAP:
                data.byteswap()
        elif datatype == "BOOL":
            data = [b != 0 for b in bytes(raw)]
        else:  # FP16
            data = list(struct.unpack(f"<{count}e", raw))
        return cls(datatype, shape, data)

    def tobytes(self) -> bytes:
        """The binary extension's bytes (little-endian; BYTES length-prefixed)."""
        data = self.data
        if isinstance(data, array):
            if _SWAP:
                data = array(data.typecode, data)
                data.byteswap()
            return data.tobytes()
        if self.datatype == BYTES:
            return pack_items(data)
        if self.datatype == "BOOL":
            return bytes(1 if v else 0 for v in data)
        try:
            return struct.pack(f"<{len(data)}e", *data)
        except (struct.error, OverflowError) as exc:
            raise BadTensor(f"FP16 data out of range: {exc}") from exc

    def tolist(self) -> Any:
        """Nested lists of Python values, as ``ndarray.tolist()`` gives them."""
        flat = self.data.tolist() if isinstance(self.data, array) else list(self.data)
        if not self.shape:
            return flat[0]
        for d in reversed(self.shape[1:]):
            flat = [flat[i:i + d] for i in range(0, len(flat), d)] if d else [[] for _ in range(len(flat))]
        return flat

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tensor):
            return NotImplemented
        return (self.datatype, self.shape, list(self.data)) == (other.datatype, other.shape, list(other.data))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Tensor({self.datatype!r}, {list(self.shape)}, {self.tolist()!r})"

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        # called by numpy only, so numpy is there; the one decoder of wire bytes into arrays is its codec's
        import numpy as np

        from mesh.v2.tensors import V2_TO_NP

        if self.datatype == BYTES:
            out = np.empty(len(self.data), dtype=object)
            out[:] = self.data
            arr = out.reshape(self.shape)
        else:
            arr = np.frombuffer(self.tobytes(), V2_TO_NP[self.datatype]).reshape(self.shape).astype(
                V2_TO_NP[self.datatype].newbyteorder("="))
        return arr if dtype is None else arr.astype(dtype)

    def __buffer__(self, flags: int) -> memoryview:
        """The buffer protocol (Python 3.12+, PEP 688) for numeric data: a ``memoryview`` shaped as the tensor."""
        if not isinstance(self.data, array):
            raise TypeError(f"a {self.datatype} tensor has no buffer (its data is a list)")
        raw: Any = memoryview(self.data).cast("B")
        return raw.cast(self.data.typecode, self.shape)  # type: ignore[no-any-return]


def fit_shape(shape: tuple[int, ...], spec: Sequence[int] | None) -> tuple[int, ...]:
    """A flat input's shape fitted to a spec with one dynamic dimension: 128 values for ``(N, 64)`` are
    ``(2, 64)``. Any other shape is returned as it is (the edge judges it)."""
    if spec is None or len(shape) != 1 or len(spec) < 2 or list(spec).count(-1) != 1:
        return shape
    fixed = math.prod(d for d in spec if d != -1)
    if fixed <= 0 or shape[0] % fixed:
        return shape
    return tuple(shape[0] // fixed if d == -1 else d for d in spec)


def _flatten(value: Any, where: str) -> tuple[tuple[int, ...], list[Any]]:
    """Shape and C-order elements of nested lists / tuples / arrays (``BadTensor`` if ragged)."""
    shape: list[int] = []
    level: list[Any] = [value]
    while type(level[0]) in _NESTED:
        n = len(level[0])
        if any(type(x) not in _NESTED or len(x) != n for x in level):
            raise BadTensor(f"{where}: nested lists of different lengths (not a tensor)")
        shape.append(n)
        level = [y for x in level for y in x]
        if not level:
            break
    if level and any(type(x) in _NESTED for x in level):
        raise BadTensor(f"{where}: nested lists of different depths (not a tensor)")
    return tuple(shape), level


def as_tensor(value: Any, datatype: str, spec_shape: Sequence[int] | None = None, where: str = "input") -> Tensor:
    """``value`` (a :class:`Tensor`, nested lists, an ``array.array``, or ``str``/``bytes`` lists for BYTES) as a
    tensor of ``datatype``; a flat one is fitted to ``spec_shape`` (:func:`fit_shape`)."""
    if isinstance(value, Tensor):
        return value
    check_datatype(datatype)
    if type(value) is array:
        shape: tuple[int, ...] = (len(value),)
        items: Any = value
    else:
        shape, items = _flatten(value, where)
    shape = fit_shape(shape, spec_shape)
    code = _CODES.get(datatype)
    try:
        if datatype == BYTES:
            return Tensor(datatype, shape, as_items(items, where))
        if code is not None:
            return Tensor(datatype, shape, array(code, items))
        if datatype == "BOOL":
            return Tensor(datatype, shape, [bool(v) for v in items])
        return Tensor(datatype, shape, [float(v) for v in items])
    except (TypeError, OverflowError, ValueError) as exc:
        raise BadTensor(f"{where}: values are not {datatype}: {exc}") from exc


def tensor_data(tensors: Mapping[str, Tensor]) -> list[bytes]:
    """What ``encode_infer_request(tensors, ...)`` puts after its header (binary mode)."""
    return [t.tobytes() for t in tensors.values()]


def _json_data(t: Tensor, name: str) -> list[Any]:
    if t.datatype != BYTES:
        return t.data.tolist() if isinstance(t.data, array) else list(t.data)
    try:
        return [b.decode("utf-8") for b in t.data]
    except UnicodeDecodeError as exc:
        raise BadTensor(f"tensor {name!r}: BYTES element is not UTF-8, so it cannot be JSON: "
                        f"ask for binary data ({exc})") from exc


def encode_infer_request(inputs: Mapping[str, Tensor], parameters: Mapping[str, Any], *,
                         request_id: str | None = None, binary: bool = True) -> tuple[bytes, int | None]:
    """As :func:`mesh.v2.codec.encode_infer_request`, byte for byte, from :class:`Tensor` objects."""
    descs: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview | None] = []
    for name, t in inputs.items():
        desc: dict[str, Any] = {"name": name, "datatype": t.datatype, "shape": list(t.shape)}
        if binary:
            raw = t.tobytes()
            desc["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            desc["data"] = _json_data(t, name)
        descs.append(desc)
    return assemble(request_head(descs, parameters, request_id, binary), blobs)


def _shape(value: object, where: str) -> tuple[int, ...]:
    if type(value) is not list or not all(type(d) is int and d >= 0 for d in value):
        raise BadTensor(f"{where}: shape must be a list of non-negative integers, got {str(value)[:200]}")
    return tuple(value)


def _from_json(datatype: str, shape: tuple[int, ...], data: object, where: str) -> Tensor:
    if type(data) is not list:
        raise BadTensor(f"{where}: 'data' must be a list, got {type(data).__name__}")
    _, items = _flatten(data, where)  # nested lists are allowed (row-major), flat ones usual
    if len(items) != math.prod(shape):
        raise BadTensor(f"{where}: data has {len(items)} elements but shape {list(shape)} needs {math.prod(shape)}")
    if datatype == BYTES and not all(type(v) is str for v in items):
        raise BadTensor(f"{where}: BYTES data must be strings")
    return Tensor(datatype, shape, as_tensor(items, datatype, where=where).data)


def decode_infer_response(body: bytes, header_length: int | None = None, *,
                          max_bytes: int = 1 << 31) -> DecodedResponse:
    """As :func:`mesh.v2.codec.decode_infer_response`, with :class:`Tensor` outputs."""
    head, tail = split_body(body, header_length, max_bytes)
    items = head.get("outputs", [])
    if type(items) is not list:
        raise BadTensor("'outputs' must be a list of tensors")
    outputs: dict[str, Tensor] = {}
    offset = 0
    for i, t in enumerate(items):
        if type(t) is not dict or type(t.get("name")) is not str:
            raise BadTensor(f"output[{i}] must be an object with a string 'name'")
        where = f"output {t['name']!r}"
        datatype = check_datatype(t.get("datatype"))
        shape = _shape(t.get("shape"), where)
        params = t.get("parameters") or {}
        size = params.get("binary_data_size") if type(params) is dict else None
        if size is None:
            outputs[t["name"]] = _from_json(datatype, shape, t.get("data"), where)
            continue
        if type(size) is not int or size < 0 or offset + size > len(tail):
            raise BadTensor(f"{where}: binary_data_size {size!r} does not fit the {len(tail) - offset} bytes left")
        outputs[t["name"]] = Tensor.from_wire(datatype, shape, tail[offset:offset + size], where)
        offset += size
    if offset != len(tail):
        raise BadTensor(f"{len(tail) - offset} bytes after the declared binary tensors")
    rid, params = response_meta(head)
    return DecodedResponse(rid, outputs, params)
