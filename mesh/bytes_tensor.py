"""BYTES tensors (Open Inference Protocol datatype ``BYTES``): text and other variable-length elements.

In memory a BYTES tensor is a numpy ``object`` array whose elements are ``bytes`` (``str`` elements
are accepted and sent as UTF-8), as ``tritonclient`` holds them; without numpy (the SDK's base install,
``mesh.v2.plain``) a flat list of ``bytes``. On the wire, in the OIP binary tensor extension and in a ZeroMQ
tensor frame alike, it is what Triton writes: for each element in C order, its length as a 4-byte little-endian
unsigned integer, then its bytes. So both wire codecs (``mesh.v2``, ``mesh.zmq``) and ``tritonclient`` agree
byte for byte. numpy is imported only by the functions that build numpy arrays.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mesh.errors import BadTensor

if TYPE_CHECKING:
    import numpy as np

__all__ = ["as_bytes_tensor", "as_items", "bytes_items", "deserialize_bytes", "pack_items", "serialize_bytes",
           "unpack_items"]

_LEN = struct.Struct("<I")


def as_items(values: Iterable[object], where: str = "tensor") -> list[bytes]:
    """Flat BYTES elements as bytes (``str`` encoded as UTF-8); ``BadTensor`` naming the first that is neither."""
    out = []
    for i, v in enumerate(values):
        if type(v) is bytes:
            out.append(v)
        elif type(v) is str:
            out.append(v.encode("utf-8"))
        elif isinstance(v, bytes | bytearray | memoryview):  # numpy's bytes_ is a bytes
            out.append(bytes(v))
        else:
            raise BadTensor(f"{where}[{i}]: a BYTES element must be bytes or str, got {type(v).__name__}")
    return out


def bytes_items(arr: np.ndarray, where: str = "tensor") -> list[bytes]:
    """The elements of a BYTES tensor in C order, as bytes (``str`` encoded as UTF-8)."""
    return as_items(arr.reshape(-1).tolist(), where)


def pack_items(items: Iterable[bytes]) -> bytes:
    """The wire form of elements already bytes: each one's 4-byte LE length, then its bytes."""
    parts: list[bytes] = []
    for b in items:
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def serialize_bytes(arr: np.ndarray, where: str = "tensor") -> bytes:
    """The wire form: each element's 4-byte LE length, then its bytes."""
    return pack_items(bytes_items(arr, where))


def unpack_items(buf: bytes | memoryview, count: int, where: str = "tensor") -> list[bytes]:
    """``count`` elements from their wire form; ``BadTensor`` unless ``buf`` holds exactly that many."""
    view = memoryview(buf).cast("B") if not isinstance(buf, bytes) else buf
    items: list[bytes] = []
    offset, end = 0, len(view)
    for i in range(count):
        if offset + 4 > end:
            raise BadTensor(f"{where}: BYTES element {i} of {count}: truncated length prefix at byte {offset}")
        (n,) = _LEN.unpack_from(view, offset)
        offset += 4
        if n > end - offset:
            raise BadTensor(f"{where}: BYTES element {i} declares {n} bytes but {end - offset} remain")
        items.append(bytes(view[offset:offset + n]))
        offset += n
    if offset != end:
        raise BadTensor(f"{where}: {end - offset} bytes after the {count} BYTES elements its shape declares")
    return items


def deserialize_bytes(buf: bytes | memoryview, shape: tuple[int, ...], where: str = "tensor") -> np.ndarray:
    """A BYTES tensor of ``shape`` from its wire form; ``BadTensor`` unless ``buf`` holds exactly
    that many length-prefixed elements."""
    import numpy as np

    count = 1
    for d in shape:
        count *= d
    out = np.empty(count, dtype=object)
    out[:] = unpack_items(buf, count, where)
    return out.reshape(shape)


def as_bytes_tensor(values: Any) -> np.ndarray:
    """A BYTES tensor from strings or bytes (a list, or a numpy ``str_``/``bytes_``/object array)."""
    import numpy as np

    arr = np.asarray(values) if not isinstance(values, np.ndarray) else values
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    flat[:] = bytes_items(np.asarray(arr, dtype=object), "text")
    return out
