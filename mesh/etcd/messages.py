"""etcd's v3 gRPC messages, written and read here in protobuf's wire format: the ones tiermesh sends and reads.

Why not protobuf's generated classes: the protobuf runtime and the classes of etcd's three proto files held
about 3 MiB of an idle edge agent (issue 17), for some twenty small messages. These are those messages, each a
class with the fields of etcd 3.5's ``rpc.proto``, ``kv.proto`` and ``auth.proto`` (same names, numbers and
types), built by keyword (``RangeRequest(key=b"k", range_end=b"l")``), read by attribute, with protobuf's
``SerializeToString`` / ``FromString`` (what grpclib's codec calls). Enum values are class attributes, as in
the generated code: ``Compare.EQUAL``, ``RangeRequest.ASCEND``, ``Event.DELETE``.

Semantics are proto3's: a scalar at its zero value is not written and reads back as zero; a field of a oneof
(``Compare``'s target, ``RequestOp``'s request, ...) is written whenever it is set, zero included, and is
``None`` when not set; a message field not present reads as ``None``; repeated varints are written packed and
read packed or not; unknown fields are skipped. ``tests/unit/test_etcd_messages.py`` checks every field here
against the descriptors protobuf generates from etcd's protos, and round-trips through both.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

__all__ = ["PACKAGE", "SERVICES", "Field", "Message", "message_class"]

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


def _fields(*spec: tuple[Any, ...]) -> tuple[Field, ...]:
    return tuple(Field(*s) for s in spec)


# ---------------------------------------------------------------- kv.proto (mvccpb)


class KeyValue(Message):
    FIELDS = _fields((1, "key", "bytes"), (2, "create_revision", "int64"), (3, "mod_revision", "int64"),
                     (4, "version", "int64"), (5, "value", "bytes"), (6, "lease", "int64"))


class Event(Message):
    PUT, DELETE = 0, 1
    FIELDS = _fields((1, "type", "enum"), (2, "kv", "message", False, "KeyValue"),
                     (3, "prev_kv", "message", False, "KeyValue"))


# ---------------------------------------------------------------- auth.proto (authpb)


class Permission(Message):
    READ, WRITE, READWRITE = 0, 1, 2
    FIELDS = _fields((1, "permType", "enum"), (2, "key", "bytes"), (3, "range_end", "bytes"))


# ---------------------------------------------------------------- rpc.proto (etcdserverpb)


class ResponseHeader(Message):
    FIELDS = _fields((1, "cluster_id", "uint64"), (2, "member_id", "uint64"), (3, "revision", "int64"),
                     (4, "raft_term", "uint64"))


_HEADER = (1, "header", "message", False, "ResponseHeader")


class RangeRequest(Message):
    NONE, ASCEND, DESCEND = 0, 1, 2                      # SortOrder
    KEY, VERSION, CREATE, MOD, VALUE = 0, 1, 2, 3, 4     # SortTarget
    FIELDS = _fields((1, "key", "bytes"), (2, "range_end", "bytes"), (3, "limit", "int64"), (4, "revision", "int64"),
                     (5, "sort_order", "enum"), (6, "sort_target", "enum"), (7, "serializable", "bool"),
                     (8, "keys_only", "bool"), (9, "count_only", "bool"), (10, "min_mod_revision", "int64"),
                     (11, "max_mod_revision", "int64"), (12, "min_create_revision", "int64"),
                     (13, "max_create_revision", "int64"))


class RangeResponse(Message):
    FIELDS = _fields(_HEADER, (2, "kvs", "message", True, "KeyValue"), (3, "more", "bool"), (4, "count", "int64"))


class PutRequest(Message):
    FIELDS = _fields((1, "key", "bytes"), (2, "value", "bytes"), (3, "lease", "int64"), (4, "prev_kv", "bool"),
                     (5, "ignore_value", "bool"), (6, "ignore_lease", "bool"))


class PutResponse(Message):
    FIELDS = _fields(_HEADER, (2, "prev_kv", "message", False, "KeyValue"))


class DeleteRangeRequest(Message):
    FIELDS = _fields((1, "key", "bytes"), (2, "range_end", "bytes"), (3, "prev_kv", "bool"))


class DeleteRangeResponse(Message):
    FIELDS = _fields(_HEADER, (2, "deleted", "int64"), (3, "prev_kvs", "message", True, "KeyValue"))


class RequestOp(Message):
    FIELDS = _fields((1, "request_range", "message", False, "RangeRequest", "request"),
                     (2, "request_put", "message", False, "PutRequest", "request"),
                     (3, "request_delete_range", "message", False, "DeleteRangeRequest", "request"),
                     (4, "request_txn", "message", False, "TxnRequest", "request"))


class ResponseOp(Message):
    FIELDS = _fields((1, "response_range", "message", False, "RangeResponse", "response"),
                     (2, "response_put", "message", False, "PutResponse", "response"),
                     (3, "response_delete_range", "message", False, "DeleteRangeResponse", "response"),
                     (4, "response_txn", "message", False, "TxnResponse", "response"))


class Compare(Message):
    EQUAL, GREATER, LESS, NOT_EQUAL = 0, 1, 2, 3          # CompareResult
    VERSION, CREATE, MOD, VALUE, LEASE = 0, 1, 2, 3, 4     # CompareTarget
    FIELDS = _fields((1, "result", "enum"), (2, "target", "enum"), (3, "key", "bytes"),
                     (4, "version", "int64", False, "", "target_union"),
                     (5, "create_revision", "int64", False, "", "target_union"),
                     (6, "mod_revision", "int64", False, "", "target_union"),
                     (7, "value", "bytes", False, "", "target_union"),
                     (8, "lease", "int64", False, "", "target_union"), (64, "range_end", "bytes"))


class TxnRequest(Message):
    FIELDS = _fields((1, "compare", "message", True, "Compare"), (2, "success", "message", True, "RequestOp"),
                     (3, "failure", "message", True, "RequestOp"))


class TxnResponse(Message):
    FIELDS = _fields(_HEADER, (2, "succeeded", "bool"), (3, "responses", "message", True, "ResponseOp"))


class CompactionRequest(Message):
    FIELDS = _fields((1, "revision", "int64"), (2, "physical", "bool"))


class CompactionResponse(Message):
    FIELDS = _fields(_HEADER)


class WatchCreateRequest(Message):
    NOPUT, NODELETE = 0, 1  # FilterType
    FIELDS = _fields((1, "key", "bytes"), (2, "range_end", "bytes"), (3, "start_revision", "int64"),
                     (4, "progress_notify", "bool"), (5, "filters", "enum", True), (6, "prev_kv", "bool"),
                     (7, "watch_id", "int64"), (8, "fragment", "bool"))


class WatchCancelRequest(Message):
    FIELDS = _fields((1, "watch_id", "int64"))


class WatchProgressRequest(Message):
    """No fields."""


class WatchRequest(Message):
    FIELDS = _fields((1, "create_request", "message", False, "WatchCreateRequest", "request_union"),
                     (2, "cancel_request", "message", False, "WatchCancelRequest", "request_union"),
                     (3, "progress_request", "message", False, "WatchProgressRequest", "request_union"))


class WatchResponse(Message):
    FIELDS = _fields(_HEADER, (2, "watch_id", "int64"), (3, "created", "bool"), (4, "canceled", "bool"),
                     (5, "compact_revision", "int64"), (6, "cancel_reason", "string"), (7, "fragment", "bool"),
                     (11, "events", "message", True, "Event"))


class LeaseGrantRequest(Message):
    FIELDS = _fields((1, "TTL", "int64"), (2, "ID", "int64"))


class LeaseGrantResponse(Message):
    FIELDS = _fields(_HEADER, (2, "ID", "int64"), (3, "TTL", "int64"), (4, "error", "string"))


class LeaseRevokeRequest(Message):
    FIELDS = _fields((1, "ID", "int64"))


class LeaseRevokeResponse(Message):
    FIELDS = _fields(_HEADER)


class LeaseKeepAliveRequest(Message):
    FIELDS = _fields((1, "ID", "int64"))


class LeaseKeepAliveResponse(Message):
    FIELDS = _fields(_HEADER, (2, "ID", "int64"), (3, "TTL", "int64"))


class AuthEnableRequest(Message):
    """No fields."""


class AuthEnableResponse(Message):
    FIELDS = _fields(_HEADER)


class UserAddOptions(Message):
    FIELDS = _fields((1, "no_password", "bool"))


class AuthUserAddRequest(Message):
    FIELDS = _fields((1, "name", "string"), (2, "password", "string"),
                     (3, "options", "message", False, "UserAddOptions"), (4, "hashedPassword", "string"))


class AuthUserAddResponse(Message):
    FIELDS = _fields(_HEADER)


class AuthRoleAddRequest(Message):
    FIELDS = _fields((1, "name", "string"))


class AuthRoleAddResponse(Message):
    FIELDS = _fields(_HEADER)


class AuthRoleGrantPermissionRequest(Message):
    FIELDS = _fields((1, "name", "string"), (2, "perm", "message", False, "Permission"))


class AuthRoleGrantPermissionResponse(Message):
    FIELDS = _fields(_HEADER)


class AuthUserGrantRoleRequest(Message):
    FIELDS = _fields((1, "user", "string"), (2, "role", "string"))


class AuthUserGrantRoleResponse(Message):
    FIELDS = _fields(_HEADER)


# service -> method -> (request, reply, streaming); paths are /etcdserverpb.<service>/<method>
SERVICES: dict[str, dict[str, tuple[str, str, bool]]] = {
    "KV": {"Range": ("RangeRequest", "RangeResponse", False), "Put": ("PutRequest", "PutResponse", False),
           "DeleteRange": ("DeleteRangeRequest", "DeleteRangeResponse", False),
           "Txn": ("TxnRequest", "TxnResponse", False), "Compact": ("CompactionRequest", "CompactionResponse", False)},
    "Watch": {"Watch": ("WatchRequest", "WatchResponse", True)},
    "Lease": {"LeaseGrant": ("LeaseGrantRequest", "LeaseGrantResponse", False),
              "LeaseRevoke": ("LeaseRevokeRequest", "LeaseRevokeResponse", False),
              "LeaseKeepAlive": ("LeaseKeepAliveRequest", "LeaseKeepAliveResponse", True)},
    "Auth": {"AuthEnable": ("AuthEnableRequest", "AuthEnableResponse", False),
             "UserAdd": ("AuthUserAddRequest", "AuthUserAddResponse", False),
             "RoleAdd": ("AuthRoleAddRequest", "AuthRoleAddResponse", False),
             "RoleGrantPermission": ("AuthRoleGrantPermissionRequest", "AuthRoleGrantPermissionResponse", False),
             "UserGrantRole": ("AuthUserGrantRoleRequest", "AuthUserGrantRoleResponse", False)},
}
PACKAGE = "etcdserverpb"
