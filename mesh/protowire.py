"""Protobuf's wire format for plain Python message classes: what etcd's messages (:mod:`mesh.etcd.messages`) and
the Open Inference Protocol's (:mod:`mesh.v2.grpc_messages`) are built on, without the protobuf runtime.

A message class lists its ``FIELDS`` (number, name, kind, repeated, message class name, oneof) and gets keyword
construction, attribute access, equality, and protobuf's ``SerializeToString`` / ``FromString`` (what grpclib's
codec calls). Kinds: ``int64``, ``uint64``, ``int32``, ``uint32``, ``enum``, ``bool`` (varints), ``double`` (64-bit),
``float`` (32-bit), ``bytes``, ``string`` and ``message``. A message field names its class, looked up in the module
that defines the message (as protobuf scopes names by package); a ``map<string, V>`` is a repeated entry message
(``key`` 1, ``value`` 2), as on the wire.

Semantics are proto3's: a scalar at its zero value is not written and reads back as zero; a field of a oneof is
written whenever it is set, zero included, and is ``None`` when not set; a message field not present reads as
``None``; repeated numbers are written packed and read packed or not; unknown fields are skipped; varints are read
and written as 64-bit two's complement (a 32-bit kind keeps its low 32 bits, as protobuf does).

Decoding is for untrusted bytes: whatever they are, :meth:`Message.FromString` returns a message or raises
:class:`DecodeError` (truncated varints, lengths past the end, unknown wire types, field number 0, invalid UTF-8
in a string, a packed run that is not whole numbers). Nothing else: ``tests/unit/test_protowire_fuzz.py``.
"""

from __future__ import annotations

import struct
import sys
from typing import Any, ClassVar, NamedTuple

from mesh.errors import ProtocolError

__all__ = ["DecodeError", "Field", "Message", "fields"]

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_VARINT_KINDS = frozenset({"int64", "uint64", "int32", "uint32", "enum", "bool"})
_FIXED: dict[str, tuple[int, str]] = {"double": (_I64, "d"), "float": (_I32, "f")}  # kind -> wire, struct code
_NUMBER_KINDS = _VARINT_KINDS | _FIXED.keys()
_ZERO: dict[str, Any] = {"int64": 0, "uint64": 0, "int32": 0, "uint32": 0, "enum": 0, "bool": False,
                         "double": 0.0, "float": 0.0, "bytes": b"", "string": ""}


class DecodeError(ProtocolError, ValueError):
    """Bytes that are not a message of the type read: the only error :meth:`Message.FromString` raises (a
    ``ValueError`` too, as the decoder's errors were before it had a type of their own)."""


class Field(NamedTuple):
    number: int
    name: str
    kind: str                  # a scalar kind above, or "message"
    repeated: bool = False
    message: str = ""          # the message's class name, for kind "message" (in the module of the message)
    oneof: str = ""            # the oneof it belongs to: written whenever set, None when not


def _varint(value: int, out: bytearray) -> None:
    value &= _MASK64
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    """The varint at ``i`` (masked to 64 bits) and the index after it; IndexError when the data ends inside it
    (``Message.FromString`` turns that into ``DecodeError``: a try costs nothing on the path that does not raise)."""
    b = data[i]
    if b < 0x80:
        return b, i + 1
    value, shift = 0, 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & _MASK64, i
        shift += 7
        if shift > 63:
            raise DecodeError("varint longer than 10 bytes")


def _scalar(kind: str, raw: int) -> Any:
    if kind == "bool":
        return raw != 0
    if kind == "int64" or kind == "enum":
        return raw - (1 << 64) if raw >= 1 << 63 else raw
    if kind == "int32":
        raw &= _MASK32
        return raw - (1 << 32) if raw >= 1 << 31 else raw
    if kind == "uint32":
        return raw & _MASK32
    return raw


class Message:
    """A protobuf message; subclasses list their fields in ``FIELDS`` (and hold them as attributes)."""

    FIELDS: ClassVar[tuple[Field, ...]] = ()
    _BY_NUMBER: ClassVar[dict[int, Field]] = {}
    _CLASSES: ClassVar[dict[str, type[Message]]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._BY_NUMBER = {f.number: f for f in cls.FIELDS}
        cls._CLASSES = {}

    def __init__(self, **values: Any) -> None:
        for f in self.FIELDS:
            if f.name in values:
                v = values.pop(f.name)
                setattr(self, f.name, list(v) if f.repeated else v)
            elif f.repeated:
                setattr(self, f.name, [])
            else:
                setattr(self, f.name, None if f.kind == "message" or f.oneof else _ZERO[f.kind])
        if values:
            raise TypeError(f"{type(self).__name__} has no field {sorted(values)[0]!r}")

    @classmethod
    def _message(cls, f: Field) -> type[Message]:
        """The class of message field ``f``, by its name in this message's module (looked up once)."""
        found = cls._CLASSES.get(f.message)
        if found is None:
            named = getattr(sys.modules[cls.__module__], f.message, None)
            if not (isinstance(named, type) and issubclass(named, Message)):
                raise TypeError(f"{cls.__name__}.{f.name}: no message class {f.message!r} in {cls.__module__}")
            found = cls._CLASSES[f.message] = named
        return found

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(getattr(self, f.name) == getattr(other, f.name) for f in self.FIELDS)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        set_ = [f"{f.name}={getattr(self, f.name)!r}" for f in self.FIELDS if _present(f, getattr(self, f.name))]
        return f"{type(self).__name__}({', '.join(set_)})"

    # -- wire format -------------------------------------------------------------------------------
    def SerializeToString(self) -> bytes:  # protobuf's name: grpclib's codec calls it
        out = bytearray()
        self._write(out)
        return bytes(out)

    def _write(self, out: bytearray) -> None:
        for f in self.FIELDS:
            value = getattr(self, f.name)
            if f.repeated:
                if not value:
                    continue
                if f.kind in _NUMBER_KINDS:  # packed
                    if f.kind in _FIXED:
                        body: bytes | bytearray = struct.pack(f"<{len(value)}{_FIXED[f.kind][1]}", *value)
                    else:
                        body = bytearray()
                        for v in value:
                            _varint(int(v), body)
                    _varint(f.number << 3 | _LEN, out)
                    _varint(len(body), out)
                    out += body
                else:
                    for v in value:
                        _write_one(f, v, out)
            elif _present(f, value):
                _write_one(f, value, out)

    @classmethod
    def FromString(cls, data: bytes) -> Any:  # protobuf's name: grpclib's codec calls it
        """The message ``data`` holds; ``DecodeError`` (and nothing else) if it holds none."""
        msg = cls()
        try:
            msg._read(bytes(data))
        except DecodeError:
            raise
        except IndexError as exc:  # a varint the data ends inside
            raise DecodeError(f"{cls.__name__}: truncated varint") from exc
        except UnicodeDecodeError as exc:
            raise DecodeError(f"{cls.__name__}: a string field is not UTF-8: {exc.reason}") from exc
        except RecursionError as exc:  # a message that holds its own type (etcd's RequestOp), nested on and on
            raise DecodeError(f"{cls.__name__}: nested too deep") from exc
        return msg

    def _read(self, data: bytes) -> None:
        fields, i, end = self._BY_NUMBER, 0, len(data)
        while i < end:
            tag, i = _read_varint(data, i)
            number, wire = tag >> 3, tag & 7
            if number == 0:
                raise DecodeError(f"{type(self).__name__}: field number 0")
            f = fields.get(number)
            if wire == _VARINT:
                raw, i = _read_varint(data, i)
                if f is not None and f.kind in _VARINT_KINDS:
                    v = _scalar(f.kind, raw)
                    if f.repeated:
                        getattr(self, f.name).append(v)
                    else:
                        setattr(self, f.name, v)
            elif wire == _LEN:
                n, i = _read_varint(data, i)
                if n > end - i:
                    raise DecodeError(f"{type(self).__name__}: field {number} declares {n} bytes, {end - i} remain")
                chunk = data[i:i + n]
                i += n
                if f is not None:
                    self._read_len(f, chunk)
            elif wire == _I64 or wire == _I32:
                size = 8 if wire == _I64 else 4
                if size > end - i:
                    raise DecodeError(f"{type(self).__name__}: field {number} truncated")
                if f is not None and f.kind in _FIXED and _FIXED[f.kind][0] == wire:
                    (v,) = struct.unpack_from("<" + _FIXED[f.kind][1], data, i)
                    if f.repeated:
                        getattr(self, f.name).append(v)
                    else:
                        setattr(self, f.name, v)
                i += size
            else:
                raise DecodeError(f"{type(self).__name__}: field {number} has unsupported wire type {wire}")

    def _read_len(self, f: Field, chunk: bytes) -> None:
        if f.kind == "message":
            sub = self._message(f)()
            sub._read(chunk)
            value: Any = sub
        elif f.kind == "bytes":
            value = chunk
        elif f.kind == "string":
            value = chunk.decode("utf-8")
        elif f.kind in _FIXED and f.repeated:  # packed
            wire, code = _FIXED[f.kind]
            size = 8 if wire == _I64 else 4
            if len(chunk) % size:
                raise DecodeError(f"{type(self).__name__}.{f.name}: {len(chunk)} bytes are no whole {f.kind}s")
            getattr(self, f.name).extend(struct.unpack(f"<{len(chunk) // size}{code}", chunk))
            return
        elif f.kind in _VARINT_KINDS and f.repeated:  # packed
            j, values = 0, getattr(self, f.name)
            while j < len(chunk):
                raw, j = _read_varint(chunk, j)
                values.append(_scalar(f.kind, raw))
            return
        else:
            return
        if f.repeated:
            getattr(self, f.name).append(value)
        else:
            setattr(self, f.name, value)


def _present(f: Field, value: Any) -> bool:
    if f.repeated:
        return bool(value)
    if f.kind == "message" or f.oneof:
        return value is not None
    return bool(value)


def _write_one(f: Field, value: Any, out: bytearray) -> None:
    if f.kind in _VARINT_KINDS:
        _varint(f.number << 3 | _VARINT, out)
        _varint(int(value), out)
        return
    if f.kind in _FIXED:
        wire, code = _FIXED[f.kind]
        _varint(f.number << 3 | wire, out)
        out += struct.pack("<" + code, value)
        return
    if f.kind == "message":
        body = bytearray()
        value._write(body)
    elif f.kind == "string":
        body = value.encode("utf-8")
    else:
        body = value
    _varint(f.number << 3 | _LEN, out)
    _varint(len(body), out)
    out += body


def fields(*spec: tuple[Any, ...]) -> tuple[Field, ...]:
    """``FIELDS`` from (number, name, kind[, repeated, message, oneof]) tuples."""
    return tuple(Field(*s) for s in spec)
