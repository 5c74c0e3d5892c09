"""The Open Inference Protocol's tensor datatypes, in one table that needs no numpy.

Each fixed-size datatype is a ``struct`` format character (standard sizes, little-endian on the wire, as the
binary extension lays them out) and a numpy dtype name (what a ``TensorSpec`` names). The numpy codec
(:mod:`mesh.v2.tensors`) builds its dtypes from this table, the plain one (:mod:`mesh.v2.plain`) its ``struct`` and
``array`` codes. ``BYTES`` (variable-length elements, ``mesh.bytes_tensor``) stands beside them; BF16 is served by
no tiermesh task, so it is rejected rather than half-supported.
"""

from __future__ import annotations

import struct
from typing import Final

from mesh.errors import BadTensor

__all__ = ["BYTES", "BYTES_NAME", "FIXED", "ITEMSIZE", "NAME_TO_V2", "V2_TO_NAME", "check_datatype", "datatype_named"]

BYTES: Final = "BYTES"
BYTES_NAME: Final = "object"  # numpy holds BYTES elements in an object array
# V2 datatype -> (struct format character, numpy dtype name)
FIXED: Final[dict[str, tuple[str, str]]] = {
    "BOOL": ("?", "bool"),
    "UINT8": ("B", "uint8"),
    "UINT16": ("H", "uint16"),
    "UINT32": ("I", "uint32"),
    "UINT64": ("Q", "uint64"),
    "INT8": ("b", "int8"),
    "INT16": ("h", "int16"),
    "INT32": ("i", "int32"),
    "INT64": ("q", "int64"),
    "FP16": ("e", "float16"),
    "FP32": ("f", "float32"),
    "FP64": ("d", "float64"),
}
ITEMSIZE: Final[dict[str, int]] = {v2: struct.calcsize("<" + fmt) for v2, (fmt, _) in FIXED.items()}
V2_TO_NAME: Final[dict[str, str]] = {**{v2: name for v2, (_, name) in FIXED.items()}, BYTES: BYTES_NAME}
NAME_TO_V2: Final[dict[str, str]] = {name: v2 for v2, name in V2_TO_NAME.items()}


def check_datatype(datatype: object) -> str:
    """``datatype`` if tiermesh serves it, else ``BadTensor`` listing those it does."""
    if type(datatype) is not str or datatype not in V2_TO_NAME:
        raise BadTensor(f"unsupported datatype {datatype!r}; expected one of {sorted(V2_TO_NAME)}")
    return datatype


def datatype_named(name: str) -> str:
    """The V2 datatype of a numpy dtype name (``"float32"``, ``"object"`` for BYTES); ``BadTensor`` for others."""
    v2 = NAME_TO_V2.get(name)
    if v2 is None:
        raise BadTensor(f"dtype {name} has no V2 datatype tiermesh serves")
    return v2
