"""What a :class:`mesh.etcd.store.Store` reads and writes, as values: a key-value (``KV``), the compares and
operations of a txn and its result, how many operations etcd takes in one txn (``chunk_ops``), and the
JSON every value is stored as. Re-exported by :mod:`mesh.etcd.store`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from mesh.errors import StoreError

if TYPE_CHECKING:
    from mesh.etcd.lease import Lease

__all__ = ["KV", "MAX_TXN_OPS", "CmpOp", "Compare", "CreateRevision", "Delete", "ModRevision", "Op", "Put",
           "TxnResult", "ValueEquals", "chunk_ops", "encode_value"]

# etcd's --max-txn-ops default: a txn with more operations in a branch is refused outright
MAX_TXN_OPS = 128
CmpOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True)
class KV:
    key: str
    value: Any
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int


@dataclass(frozen=True)
class ModRevision:
    key: str
    op: CmpOp
    revision: int


@dataclass(frozen=True)
class CreateRevision:
    """``CreateRevision(key, "==", 0)`` holds when the key is absent."""

    key: str
    op: CmpOp
    revision: int


@dataclass(frozen=True)
class ValueEquals:
    key: str
    value: Any


@dataclass(frozen=True)
class Put:
    key: str
    value: Any
    lease: Lease | None = None


@dataclass(frozen=True)
class Delete:
    key: str


Compare = ModRevision | CreateRevision | ValueEquals
Op = Put | Delete


def encode_value(value: Any) -> bytes:
    """Strict JSON, as every reader decodes it (``mesh.etcd.store.decode_json``): no NaN or infinities, which
    readers refuse."""
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise StoreError(f"value is not JSON-serialisable: {exc}") from exc


def chunk_ops(ops: Sequence[Op], max_ops: int = MAX_TXN_OPS, max_bytes: int = 1 << 20) -> list[list[Op]]:
    """``ops`` cut, in order, into runs etcd accepts in one txn: at most ``max_ops`` operations and about
    ``max_bytes`` of keys and values each (etcd's request limit is 1.5 MiB by default)."""
    if max_ops < 1:
        raise ValueError(f"max_ops must be at least 1, got {max_ops}")
    out: list[list[Op]] = []
    size = 0
    for op in ops:
        n = len(op.key) + (len(encode_value(op.value)) if isinstance(op, Put) else 0)
        if not out or len(out[-1]) >= max_ops or (out[-1] and size + n > max_bytes):
            out.append([])
            size = 0
        out[-1].append(op)
        size += n
    return out
