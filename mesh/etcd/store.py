"""The one wrapper over etcd. Nothing else in tiermesh imports ``aetcd``.

Keys given to a :class:`Store` are relative to its prefix (default ``/tiermesh/``); values are JSON.
aetcd only provides the gRPC channel and generated stubs here: requests are built on the stubs
directly because aetcd drops the response header (so the revision) of txns, and its watcher does
not survive an etcd restart (its stream task cannot be restarted once it failed).

Leases (:mod:`mesh.etcd.lease`) and watches (:mod:`mesh.etcd.watch`) keep their own state and logic in
their modules but reach etcd only through the store; their classes are re-exported here. Leader
election (built on this) lives in :mod:`mesh.etcd.election`.

Errors: unreachable etcd -> ``StoreUnavailable``; other failures -> ``StoreError``; a lost
compare-and-swap -> ``ConflictError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import aetcd
from aetcd import rpc
from aetcd import utils as aetcd_utils

from mesh.errors import ConflictError, StoreError, StoreUnavailable
from mesh.etcd.lease import Lease
from mesh.etcd.watch import Compacted, Watch, WatchEvent
from mesh.lifecycle import Service, State
from mesh.log import get_logger

__all__ = [
    "KV",
    "Compare",
    "CreateRevision",
    "Delete",
    "ModRevision",
    "Op",
    "Put",
    "Store",
    "TxnResult",
    "ValueEquals",
]

log = get_logger(__name__)
T = TypeVar("T")

# gRPC reconnects with exponential back-off up to 120 s by default: far too slow to notice that a
# restarted etcd is back. Keepalive finds streams whose TCP connection died silently; etcd refuses
# pings more often than every 5 s.
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.max_receive_message_length": 16 * 1024 * 1024,
}
_DOWN_CODES = {rpc.StatusCode.UNAVAILABLE, rpc.StatusCode.DEADLINE_EXCEEDED, rpc.StatusCode.CANCELLED}
_OPS = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, "<": rpc.Compare.LESS, ">": rpc.Compare.GREATER}
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


def _encode(value: Any) -> bytes:
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise StoreError(f"value is not JSON-serialisable: {exc}") from exc


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        # Written by something other than tiermesh: hand it over as text rather than fail a loop.
        return raw.decode("utf-8", errors="replace")


def _range_end(prefix: bytes) -> bytes:
    return bytes(aetcd_utils.prefix_range_end(prefix))


def _translate(exc: BaseException, what: str) -> StoreError:
    if isinstance(exc, rpc.AioRpcError):
        cls = StoreUnavailable if exc.code() in _DOWN_CODES else StoreError
        return cls(f"{what}: {exc.code().name}: {exc.details()}")
    if isinstance(exc, TimeoutError):
        return StoreUnavailable(f"{what}: timed out")
    return StoreError(f"{what}: {exc!r}")


@contextlib.contextmanager
def _errors(what: str) -> Iterator[None]:
    try:
        yield
    except (rpc.AioRpcError, TimeoutError, aetcd.ClientError) as exc:
        raise _translate(exc, what) from exc


class Store(Service):
    """A connection to etcd under one key prefix. Create with ``await Store.connect(url)``."""

    def __init__(self, client: aetcd.Client, url: str, prefix: str, timeout: float) -> None:
        self._client = client
        self.url = url
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._bprefix = self.prefix.encode()
        self.timeout = timeout
        self._leases: set[Lease] = set()
        self._watches: set[Watch] = set()

    @classmethod
    async def connect(cls, url: str, prefix: str = "/tiermesh/", *, timeout: float = 5.0) -> Store:  # noqa: ASYNC109
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "") or not parts.hostname:
            raise StoreUnavailable(f"unsupported etcd URL {url!r} (expected http://host:port)")
        client = aetcd.Client(host=parts.hostname, port=parts.port or 2379, timeout=timeout,
                              options=dict(_CHANNEL_OPTIONS))
        store = cls(client, url, prefix, timeout)
        try:
            await store.start()
        except (StoreError, TimeoutError, aetcd.ClientError) as exc:
            raise StoreUnavailable(f"etcd at {url} unreachable: {exc}") from exc
        return store

    async def _start(self) -> None:
        await self._client.connect()
        await asyncio.wait_for(self.revision(), self.timeout)

    # -- plumbing -------------------------------------------------------------------------------
    def _k(self, key: str) -> bytes:
        return self._bprefix + key.encode()

    def _rel(self, key: bytes) -> str:
        return key[len(self._bprefix):].decode()

    def _kv(self, raw: Any) -> KV:
        return KV(self._rel(raw.key), _decode(raw.value), raw.mod_revision, raw.create_revision, raw.lease)

    @property
    def _md(self) -> Any:
        return self._client.metadata

    def _stub(self, name: str) -> Any:
        if self.state is State.STOPPED or self._client.kvstub is None:
            raise StoreError("store is closed")
        if name == "watchstub":
            return rpc.WatchStub(self._client.channel)
        return getattr(self._client, name)

    async def _unary(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        with _errors(what):
            return await call()

    async def _range(self, prefix: str) -> tuple[list[KV], int]:
        k = self._k(prefix)
        req = rpc.RangeRequest(key=k, range_end=_range_end(k), sort_order=rpc.RangeRequest.ASCEND,
                               sort_target=rpc.RangeRequest.KEY)
        resp = await self._unary(f"get_prefix {prefix!r}", lambda: self._stub("kvstub").Range(
            req, timeout=self.timeout, metadata=self._md))
        return [self._kv(x) for x in resp.kvs], resp.header.revision

    # -- key/value ------------------------------------------------------------------------------
    async def get(self, key: str) -> KV | None:
        req = rpc.RangeRequest(key=self._k(key))
        resp = await self._unary(f"get {key!r}", lambda: self._stub("kvstub").Range(
            req, timeout=self.timeout, metadata=self._md))
        return self._kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: str) -> list[KV]:
        return (await self._range(prefix))[0]

    async def put(self, key: str, value: Any, *, lease: Lease | None = None) -> int:
        req = rpc.PutRequest(key=self._k(key), value=_encode(value), lease=lease.id if lease else 0)
        resp = await self._unary(f"put {key!r}", lambda: self._stub("kvstub").Put(
            req, timeout=self.timeout, metadata=self._md))
        return int(resp.header.revision)

    async def _delete(self, key: bytes, range_end: bytes | None, what: str) -> int:
        req = rpc.DeleteRangeRequest(key=key, range_end=range_end or b"")
        resp = await self._unary(what, lambda: self._stub("kvstub").DeleteRange(
            req, timeout=self.timeout, metadata=self._md))
        return int(resp.deleted)

    async def delete(self, key: str) -> bool:
        return await self._delete(self._k(key), None, f"delete {key!r}") > 0

    async def delete_prefix(self, prefix: str) -> int:
        k = self._k(prefix)
        return await self._delete(k, _range_end(k), f"delete_prefix {prefix!r}")

    async def revision(self) -> int:
        """The current revision of the whole etcd key space."""
        req = rpc.RangeRequest(key=self._bprefix, range_end=_range_end(self._bprefix), count_only=True)
        resp = await self._unary("revision", lambda: self._stub("kvstub").Range(
            req, timeout=self.timeout, metadata=self._md))
        return int(resp.header.revision)

    # -- transactions ---------------------------------------------------------------------------
    def _compare(self, c: Compare) -> Any:
        if isinstance(c, ValueEquals):
            return rpc.Compare(key=self._k(c.key), result=rpc.Compare.EQUAL, target=rpc.Compare.VALUE,
                               value=_encode(c.value))
        if isinstance(c, ModRevision):
            return rpc.Compare(key=self._k(c.key), result=_OPS[c.op], target=rpc.Compare.MOD,
                               mod_revision=c.revision)
        return rpc.Compare(key=self._k(c.key), result=_OPS[c.op], target=rpc.Compare.CREATE,
                           create_revision=c.revision)

    def _op(self, op: Op) -> Any:
        if isinstance(op, Put):
            return rpc.RequestOp(request_put=rpc.PutRequest(
                key=self._k(op.key), value=_encode(op.value), lease=op.lease.id if op.lease else 0))
        return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=self._k(op.key)))

    async def _txn_raw(self, compares: list[Compare], success: list[Any], failure: list[Any]) -> Any:
        req = rpc.TxnRequest(compare=[self._compare(c) for c in compares], success=success, failure=failure)
        return await self._unary("txn", lambda: self._stub("kvstub").Txn(
            req, timeout=self.timeout, metadata=self._md))

    async def txn(self, compares: list[Compare], success: list[Op],
                  failure: list[Op] | None = None) -> TxnResult:
        resp = await self._txn_raw(compares, [self._op(o) for o in success],
                                   [self._op(o) for o in failure or []])
        return TxnResult(bool(resp.succeeded), int(resp.header.revision))

    async def put_if_mod_revision(self, key: str, value: Any, expected: int) -> int:
        """Write only if ``key`` is still at ``expected`` (0: only if absent); returns the new revision."""
        cmp: Compare = CreateRevision(key, "==", 0) if expected == 0 else ModRevision(key, "==", expected)
        resp = await self._txn_raw([cmp], [self._op(Put(key, value))],
                                   [rpc.RequestOp(request_range=rpc.RangeRequest(key=self._k(key)))])
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            actual = int(kvs[0].mod_revision) if kvs else 0
            raise ConflictError(f"{key!r} changed: expected revision {expected}, found {actual}",
                                key=key, expected=expected, actual=actual)
        return int(resp.header.revision)

    # -- leases ---------------------------------------------------------------------------------
    async def lease(self, ttl: float) -> Lease:
        """Grant a lease (etcd rounds the TTL up to whole seconds, at least 2) kept alive in the
        background until revoked or the store is closed."""
        req = rpc.LeaseGrantRequest(TTL=max(1, math.ceil(ttl)))
        resp = await self._unary("lease grant", lambda: self._stub("leasestub").LeaseGrant(
            req, timeout=self.timeout, metadata=self._md))
        if resp.error:
            raise StoreError(f"lease grant refused: {resp.error}")
        lease = Lease(self, int(resp.ID), float(resp.TTL))
        self._leases.add(lease)
        await lease.start()
        return lease

    async def revoke_lease(self, lease_id: int) -> bool:
        """Revoke any lease by id (its keys are deleted). False if it did not exist."""
        req = rpc.LeaseRevokeRequest(ID=lease_id)
        try:
            await self._stub("leasestub").LeaseRevoke(req, timeout=self.timeout, metadata=self._md)
        except rpc.AioRpcError as exc:
            if exc.code() == rpc.StatusCode.NOT_FOUND:
                return False
            raise _translate(exc, "lease revoke") from exc
        return True

    async def _keepalive_once(self, lease_id: int, timeout: float) -> int:  # noqa: ASYNC109
        """One keep-alive round trip; returns the TTL etcd granted (<= 0: the lease is gone)."""
        req = rpc.LeaseKeepAliveRequest(ID=lease_id)
        with _errors("lease keep-alive"):
            call = self._stub("leasestub").LeaseKeepAlive(iter([req]), timeout=timeout, metadata=self._md)
            try:
                async for reply in call:
                    return int(reply.TTL)
            finally:
                call.cancel()
        return 0

    # -- watches --------------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> Watch:
        """Events under ``prefix`` from ``start_revision`` (default: changes after the watch starts,
        i.e. after ``async with`` or the first ``anext``)."""
        return Watch(self, prefix, start_revision)

    async def _watch_stream(self, prefix: str, start_revision: int,
                            ) -> AsyncGenerator[tuple[list[WatchEvent], bool, int], None]:
        """One gRPC watch stream under ``prefix`` from ``start_revision``, for :class:`Watch`: yields
        (events, created, header revision) per response until the stream fails. Raises
        ``Compacted`` if etcd compacted past ``start_revision``, ``StoreError`` for anything else.
        Close it (``contextlib.aclosing``) to cancel the stream."""
        key = self._k(prefix)
        create = rpc.WatchCreateRequest(key=key, range_end=_range_end(key), start_revision=start_revision,
                                        progress_notify=True)
        forever = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield rpc.WatchRequest(create_request=create)
            await forever.wait()  # keep our half of the stream open

        call = self._stub("watchstub").Watch(requests(), metadata=self._md)
        try:
            with _errors(f"watch {prefix!r}"):
                async for resp in call:
                    if resp.compact_revision:
                        raise Compacted(int(resp.compact_revision))
                    if resp.canceled:
                        raise StoreError(f"watch canceled by etcd: {resp.cancel_reason}")
                    events: list[WatchEvent] = []
                    for ev in resp.events:
                        kind: Literal["put", "delete"] = "delete" if ev.type == rpc.Event.DELETE else "put"
                        value = _decode(ev.kv.value) if kind == "put" else None
                        events.append(WatchEvent(kind, self._rel(ev.kv.key), value, int(ev.kv.mod_revision)))
                    yield events, bool(resp.created), int(resp.header.revision)
        finally:
            call.cancel()

    # -- lifecycle ------------------------------------------------------------------------------
    async def close(self) -> None:
        await self.stop()

    async def _stop(self) -> None:
        for w in list(self._watches):
            await w.close()
        for lease in list(self._leases):
            # Revoking makes this process's leased keys vanish now rather than a TTL later.
            with contextlib.suppress(StoreError, TimeoutError):
                await asyncio.wait_for(lease.revoke(), min(self.timeout, 2.0))
        await self._client.close()

    def __repr__(self) -> str:
        return f"Store({self.url}, prefix={self.prefix!r}, {self.state.value})"
