"""Protobuf's wire format for plain Python message classes: what :mod:`mesh.etcd.messages` is built on.

A message class lists its ``FIELDS`` (number, name, kind, repeated, message class name, oneof) and gets keyword
construction, attribute access, equality, and protobuf's ``SerializeToString`` / ``FromString`` (what grpclib's
codec calls). Kinds: ``int64``, ``uint64``, ``int32``, ``enum``, ``bool`` (varints), ``bytes``, ``string`` and
``message``; fixed-width and zigzag kinds are not needed by etcd's API and not written (read as unknown: skipped).

Semantics are proto3's: a scalar at its zero value is not written and reads back as zero; a field of a oneof is
written whenever it is set, zero included, and is ``None`` when not set; a message field not present reads as
``None``; repeated varints are written packed and read packed or not; unknown fields are skipped; truncated
input raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

__all__ = ["Field", "Message", "fields", "message_class"]

_MASK64 = (1 << 64) - 1
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_VARINT_KINDS = frozenset({"int64", "uint64", "int32", "enum", "bool"})
_SIGNED = frozenset({"int64", "int32", "enum"})
_ZERO: dict[str, Any] = {"int64": 0, "uint64": 0, "int32": 0, "enum": 0, "bool": False, "bytes": b"", "string": ""}


class Field(NamedTuple):
    number: int
    name: str
    kind: str                  # a scalar kind above, or "message"
    repeated: bool = False
    message: str = ""          # the message's class name, for kind "message"
    oneof: str = ""            # the oneof it belongs to: written whenever set, None when not


_REGISTRY: dict[str, type[Message]] = {}


def message_class(name: str) -> type[Message]:
    """The message class called ``name`` (``RangeRequest``)."""
    return _REGISTRY[name]


def _varint(value: int, out: bytearray) -> None:
    value &= _MASK64
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    b = data[i]
    if b < 0x80:
        return b, i + 1
    value, shift = 0, 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _scalar(kind: str, raw: int) -> Any:
    if kind == "bool":
        return raw != 0
    if kind in _SIGNED and raw >= 1 << 63:
        return raw - (1 << 64)
    return raw


class Message:
    """A protobuf message of etcd's API; subclasses list their fields in ``FIELDS`` (and hold them as attributes)."""

    FIELDS: ClassVar[tuple[Field, ...]] = ()
    _BY_NUMBER: ClassVar[dict[int, Field]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._BY_NUMBER = {f.number: f for f in cls.FIELDS}
        _REGISTRY[cls.__name__] = cls

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
                if f.kind in _VARINT_KINDS:  # packed
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
        msg = cls()
        msg._read(bytes(data))
        return msg

    def _read(self, data: bytes) -> None:
        fields, i, end = self._BY_NUMBER, 0, len(data)
        while i < end:
            tag, i = _read_varint(data, i)
            number, wire = tag >> 3, tag & 7
            if wire == _VARINT:
                raw, i = _read_varint(data, i)
                f = fields.get(number)
                if f is not None and f.kind in _VARINT_KINDS:
                    v = _scalar(f.kind, raw)
                    if f.repeated:
                        getattr(self, f.name).append(v)
                    else:
                        setattr(self, f.name, v)
            elif wire == _LEN:
                n, i = _read_varint(data, i)
                chunk = data[i:i + n]
                if len(chunk) != n:
                    raise ValueError("truncated message")
                i += n
                f = fields.get(number)
                if f is not None:
                    self._read_len(f, chunk)
            elif wire == _I64:
                i += 8
            elif wire == _I32:
                i += 4
            else:
                raise ValueError(f"unsupported wire type {wire}")
        if i != end:
            raise ValueError("truncated message")

    def _read_len(self, f: Field, chunk: bytes) -> None:
        if f.kind == "message":
            sub = _REGISTRY[f.message]()
            sub._read(chunk)
            value: Any = sub
        elif f.kind == "bytes":
            value = chunk
        elif f.kind == "string":
            value = chunk.decode("utf-8")
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
