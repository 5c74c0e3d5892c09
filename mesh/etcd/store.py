"""The one wrapper over etcd. Nothing else in tiermesh talks to it.

Keys given to a :class:`Store` are relative to its prefix (default ``/tiermesh/``); values are JSON.
Requests are etcd's gRPC API, built here on its messages and sent over :mod:`mesh.etcd.wire` (gRPC on
grpclib): every response header (so the revision) is kept, and a watch stream that failed is simply opened
again.

Leases (:mod:`mesh.etcd.lease`) and watches (:mod:`mesh.etcd.watch`) keep their own state and logic in
their modules but reach etcd only through the store; their classes are re-exported here. Leader
election (built on this) lives in :mod:`mesh.etcd.election`.

Several members: ``Store.connect("http://a:2379,http://b:2379")`` (or a list) talks to one member at
a time and moves to the next when a request to it fails with ``UNAVAILABLE`` or times out (the
reasons for doing this here rather than in gRPC's balancer are in :mod:`mesh.etcd.channels`). Reads,
puts, deletes and lease keep-alives are retried on the next member within the request's timeout; a
txn is not (it may have committed), its caller sees ``StoreUnavailable`` and retries from a fresh read.
Watches resume on the next member from their last revision + 1. ``https://`` URLs with a CA file (and a
client certificate and key, for etcd's ``--client-cert-auth``) open TLS channels.

Values. Whoever wrote a value, a reader gets strict JSON or an :class:`Undecodable` (:func:`decode_json` says what
strict means): a site may write its own keys, so a compromised one any bytes etcd takes, and one such value must
neither fail a read of many keys nor kill a watch.

Errors: bad URLs or TLS files -> ``ConfigError``; unreachable etcd -> ``StoreUnavailable``; other
failures -> ``StoreError``; a request etcd's RBAC refuses -> ``StorePermissionDenied`` (a ``StoreError``,
in :mod:`mesh.etcd.channels`; also from ``connect`` when the identity may not even read the prefix); a
lost compare-and-swap -> ``ConflictError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from mesh.backoff import Backoff
from mesh.errors import ConflictError, ProtocolError, StoreError, StoreUnavailable
from mesh.etcd import messages as rpc
from mesh.etcd.channels import Channels, Member, StorePermissionDenied, rpc_errors, tls_hint, translate
from mesh.etcd.endpoints import EtcdEndpoints, parse_endpoints
from mesh.etcd.keys import LIVE, PKI_SITES
from mesh.etcd.lease import Lease
from mesh.etcd.ops import (
    KV,
    Compare,
    CreateRevision,
    ModRevision,
    Op,
    Put,
    TxnResult,
    ValueEquals,
    encode_value,
)
from mesh.etcd.watch import Compacted, KeyRange, Watch, WatchEvent
from mesh.etcd.wire import RpcError, StatusCode, prefix_end
from mesh.lifecycle import Service, State
from mesh.log import get_logger

__all__ = ["MAX_DEPTH", "SITE_VALUE_LIMITS", "Store", "Undecodable", "decode_json"]

log = get_logger(__name__)
T = TypeVar("T")

# watch streams ask the member to end them when it loses its leader, as etcd's own client does, so
# a member cut off from the quorum cannot hold a watch silent
_WATCH_MD = (("hasleader", "true"),)
# what connecting retries (a member restarting, or electing a leader); anything else fails at once
_RETRY_CONNECT = frozenset({StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED,
                            StatusCode.UNKNOWN})  # etcd: "context deadline exceeded" mid-election
_OPS = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, "<": rpc.Compare.LESS, ">": rpc.Compare.GREATER}

# Every tiermesh value is an object a few levels deep, with int64 integers and finite floats. Past these limits a
# value was not written by tiermesh, and would cost its readers a RecursionError, an OverflowError or a number no
# table holds.
MAX_DEPTH = 32
_INT64 = 2**63
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # only these decode to a lone surrogate
# The keys a site may write (mesh.etcd.rbac.site_role) hold small values: its heartbeat (a few KiB; a large mesh's
# demand by task, class and tenant, tens) and its certificate (at most 16 KiB of PEM). A bigger value there was
# written to cost its readers time: 1 MB of small JSON entries took 80-115 ms to decode and check here, on the event
# loop of every agent following the key. So it is refused unread.
SITE_VALUE_LIMITS: tuple[tuple[str, int], ...] = ((LIVE, 256 * 1024), (PKI_SITES, 64 * 1024))


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a reader gets for a value that is not strict JSON: why, and its size. It is no JSON type, so a reader
    that checks what it got never takes it for a record."""

    reason: str
    size: int


def decode_json(raw: bytes) -> Any:
    """``raw`` as strict JSON: UTF-8 (RFC 8259), no NaN or infinity (written so, or a float too large to hold),
    integers within int64, nested at most ``MAX_DEPTH`` deep, no lone surrogate in a string. Anything else raises
    ``ProtocolError``, the only error this raises whatever the bytes."""
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite, parse_int=_int64)
        strings = _SURROGATE_ESCAPE.search(raw) is not None
        # counting brackets (in C) bounds the depth, so only a value with many containers is walked
        if strings or raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:
            _check_shape(value, strings=strings)
    except Exception as exc:  # hostile bytes raise more than ValueError (RecursionError, deep down): all one here
        why = f"{type(exc).__name__}: {str(exc)[:160]}"
        raise ProtocolError(f"not a strict JSON value ({len(raw)} bytes): {why}") from exc
    return value


def _read_value(key: str, raw: bytes) -> Any:
    """The value at ``key`` for a reader: its JSON, or an :class:`Undecodable` (a read of many keys goes on past
    it), unread when over the limit of a key a site writes (``SITE_VALUE_LIMITS``)."""
    for prefix, limit in SITE_VALUE_LIMITS:
        if len(raw) > limit and key.startswith(prefix):
            return Undecodable(f"{len(raw)} bytes, over the {limit} a value at {prefix}* may hold", len(raw))
    try:
        return decode_json(raw)
    except ProtocolError as exc:
        return Undecodable(exc.message, len(raw))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    out = float(text)
    if not math.isfinite(out):
        raise ValueError(f"{text[:40]} does not fit a float")
    return out


def _int64(text: str) -> int:
    out = int(text)  # over 4300 digits: ValueError (CPython's own limit)
    if not -_INT64 <= out < _INT64:
        raise ValueError(f"{text[:40]}... does not fit an int64")
    return out


def _check_shape(value: Any, *, strings: bool) -> None:
    """``ValueError`` when ``value`` nests deeper than ``MAX_DEPTH`` or (``strings``) holds a lone surrogate.
    Iterative: the value's depth must not cost this walk the recursion the limit is there to spare."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = [*item, *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            if strings and isinstance(item, str):
                item.encode("utf-8")  # UnicodeEncodeError (a ValueError) for a lone surrogate
            continue
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH}")
        stack.extend((child, depth + 1) for child in children)


class Store(Service):
    """A connection to an etcd cluster under one key prefix. Create with ``await Store.connect(urls)``."""

    def __init__(self, endpoints: EtcdEndpoints, prefix: str, timeout: float, probe: str | None = None) -> None:
        self.endpoints = endpoints
        self._channels = Channels(endpoints)
        self.url = str(endpoints)
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._bprefix = self.prefix.encode()
        # what connecting and revision() ask etcd about (any answer carries the revision): the whole prefix, or
        # the one key an identity that may read only that key may read (a CRL follower: pki/crl)
        self._probe = (self._bprefix, prefix_end(self._bprefix)) if probe is None else (self._k(probe), b"")
        self.timeout = timeout
        self._leases: set[Lease] = set()
        self._watches: set[Watch] = set()

    @classmethod
    async def connect(cls, urls: str | list[str] | tuple[str, ...] | EtcdEndpoints, prefix: str = "/tiermesh/",
                      *, timeout: float = 5.0, ca: str | Path | None = None,  # noqa: ASYNC109
                      cert: str | Path | None = None, key: str | Path | None = None,
                      probe: str | None = None) -> Store:
        """Connect to the first member of ``urls`` (comma-separated or a list) that answers.
        ``ConfigError`` for bad URLs or TLS files, ``StoreUnavailable`` if no member answers. ``probe``: a key
        (under the prefix) to ask about instead of the whole prefix, for an identity RBAC lets read that key only."""
        store = cls(parse_endpoints(urls, ca=ca, cert=cert, key=key), prefix, timeout, probe)
        try:
            await store.start()
        except StorePermissionDenied:
            raise
        except (StoreError, TimeoutError) as exc:
            raise StoreUnavailable(f"etcd at {store.url} unreachable: {exc}") from exc
        return store

    async def _start(self) -> None:
        """Try the members in turn until one answers or ``timeout`` is spent. A member that refuses or
        has no leader yet (the moment after a leader died) is tried again in the next round; an answer
        that no retry can change (TLS refused, permission denied) ends the attempt at once."""
        errors: dict[str, str] = {}
        # each member gets a share of the timeout, so one black-holed member cannot eat all of it
        per_member = max(self.timeout / len(self._channels), min(self.timeout, 1.0))
        deadline = time.monotonic() + self.timeout
        backoff = Backoff(0.05, 0.5)  # jittered: the agents of a mesh whose etcd restarted do not dial it together
        while True:
            for i, target in enumerate(self.endpoints.targets):
                left = deadline - time.monotonic()
                if left <= 0 and errors:
                    raise StoreUnavailable("; ".join(f"{t}: {e}" for t, e in errors.items()))
                wait = min(per_member, max(left, 0.2))
                self._channels.use(i)
                try:
                    async with asyncio.timeout(wait + 0.5):
                        await self._revision_once(wait)
                    return
                except RpcError as exc:
                    if exc.code() == StatusCode.PERMISSION_DENIED:
                        raise translate(exc, f"connect [{target}]") from exc
                    details = f"{exc.code().name}: {exc.details()}"
                    errors[target] = f"{details}{tls_hint(details, self.endpoints)}"
                    if exc.code() not in _RETRY_CONNECT:
                        raise StoreUnavailable("; ".join(f"{t}: {e}" for t, e in errors.items())) from exc
                except TimeoutError:
                    errors[target] = f"no answer in {wait:.1f} s"
            await asyncio.sleep(backoff.next())

    @property
    def member(self) -> str:
        """``host:port`` of the member requests go to now."""
        return self._channels.target

    # -- plumbing -------------------------------------------------------------------------------
    def _k(self, key: str) -> bytes:
        return self._bprefix + key.encode()

    def _rel(self, key: bytes) -> str:
        # a key written by something else need not be UTF-8: kept (its bytes as surrogates) rather than fail a read
        return key[len(self._bprefix):].decode("utf-8", errors="surrogateescape")

    def _kv(self, raw: Any) -> KV:
        key = self._rel(raw.key)
        return KV(key, _read_value(key, raw.value), raw.mod_revision, raw.create_revision, raw.lease)

    def _member(self) -> tuple[int, Member]:
        if self.state is State.STOPPED or self._channels.closed:
            raise StoreError("store is closed")
        return self._channels.current()

    def _failed(self, generation: int, exc: BaseException) -> None:
        self._channels.failed(generation, exc)

    async def _unary(self, what: str, call: Callable[[Member, float], Awaitable[T]], *,
                     idempotent: bool = True) -> T:
        if self.state is State.STOPPED:
            raise StoreError("store is closed")
        return await self._channels.call(what, call, self.timeout, idempotent=idempotent)

    async def call(self, what: str, call: Callable[[Member, float], Awaitable[T]], *,
                   idempotent: bool = True) -> T:
        """A raw request (``call(member, timeout)``) with the store's failover and errors (for rbac)."""
        return await self._unary(what, call, idempotent=idempotent)

    async def _revision_once(self, timeout: float) -> int:  # noqa: ASYNC109
        req = rpc.RangeRequest(key=self._probe[0], range_end=self._probe[1], count_only=True)
        _, member = self._member()
        resp = await member.kv.Range(req, timeout=timeout)
        return int(resp.header.revision)

    async def _range(self, prefix: str) -> tuple[list[KV], int]:
        k = self._k(prefix)
        req = rpc.RangeRequest(key=k, range_end=prefix_end(k), sort_order=rpc.RangeRequest.ASCEND,
                               sort_target=rpc.RangeRequest.KEY)
        resp = await self._unary(f"get_prefix {prefix!r}", lambda m, t: m.kv.Range(req, timeout=t))
        return [self._kv(x) for x in resp.kvs], resp.header.revision

    # -- key/value ------------------------------------------------------------------------------
    async def get(self, key: str) -> KV | None:
        req = rpc.RangeRequest(key=self._k(key))
        resp = await self._unary(f"get {key!r}", lambda m, t: m.kv.Range(req, timeout=t))
        return self._kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: str) -> list[KV]:
        return (await self._range(prefix))[0]

    async def get_range(self, r: KeyRange) -> list[KV]:
        """The keys of one :class:`KeyRange`, in key order."""
        key, end = self._range_keys(r)
        req = rpc.RangeRequest(key=key, range_end=end, sort_order=rpc.RangeRequest.ASCEND,
                               sort_target=rpc.RangeRequest.KEY)
        resp = await self._unary(f"get {r}", lambda m, t: m.kv.Range(req, timeout=t))
        return [self._kv(x) for x in resp.kvs]

    async def put(self, key: str, value: Any, *, lease: Lease | None = None) -> int:
        req = rpc.PutRequest(key=self._k(key), value=encode_value(value), lease=lease.id if lease else 0)
        resp = await self._unary(f"put {key!r}", lambda m, t: m.kv.Put(req, timeout=t))
        return int(resp.header.revision)

    async def _delete(self, key: bytes, range_end: bytes | None, what: str) -> int:
        req = rpc.DeleteRangeRequest(key=key, range_end=range_end or b"")
        resp = await self._unary(what, lambda m, t: m.kv.DeleteRange(req, timeout=t))
        return int(resp.deleted)

    async def delete(self, key: str) -> bool:
        return await self._delete(self._k(key), None, f"delete {key!r}") > 0

    async def delete_prefix(self, prefix: str) -> int:
        k = self._k(prefix)
        return await self._delete(k, prefix_end(k), f"delete_prefix {prefix!r}")

    async def revision(self) -> int:
        """The current revision of the whole etcd key space."""
        req = rpc.RangeRequest(key=self._probe[0], range_end=self._probe[1], count_only=True)
        resp = await self._unary("revision", lambda m, t: m.kv.Range(req, timeout=t))
        return int(resp.header.revision)

    async def compact(self, revision: int) -> None:
        """Drop the history before ``revision`` in the whole key space (an admin action)."""
        req = rpc.CompactionRequest(revision=revision, physical=True)
        await self._unary("compact", lambda m, t: m.kv.Compact(req, timeout=t))

    # -- transactions ---------------------------------------------------------------------------
    def _compare(self, c: Compare) -> Any:
        if isinstance(c, ValueEquals):
            return rpc.Compare(key=self._k(c.key), result=rpc.Compare.EQUAL, target=rpc.Compare.VALUE,
                               value=encode_value(c.value))
        if isinstance(c, ModRevision):
            return rpc.Compare(key=self._k(c.key), result=_OPS[c.op], target=rpc.Compare.MOD,
                               mod_revision=c.revision)
        return rpc.Compare(key=self._k(c.key), result=_OPS[c.op], target=rpc.Compare.CREATE,
                           create_revision=c.revision)

    def _op(self, op: Op) -> Any:
        if isinstance(op, Put):
            return rpc.RequestOp(request_put=rpc.PutRequest(
                key=self._k(op.key), value=encode_value(op.value), lease=op.lease.id if op.lease else 0))
        return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=self._k(op.key)))

    async def _txn_raw(self, compares: list[Compare], success: list[Any], failure: list[Any]) -> Any:
        req = rpc.TxnRequest(compare=[self._compare(c) for c in compares], success=success, failure=failure)
        return await self._unary("txn", lambda m, t: m.kv.Txn(req, timeout=t), idempotent=False)

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
        resp = await self._unary("lease grant", lambda m, t: m.lease.LeaseGrant(req, timeout=t))
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
            await self._unary("lease revoke", lambda m, t: m.lease.LeaseRevoke(req, timeout=t))
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, RpcError) and cause.code() == StatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def _keepalive_once(self, lease_id: int, timeout: float) -> int:  # noqa: ASYNC109
        """One keep-alive round trip; returns the TTL etcd granted (<= 0: the lease is gone)."""
        req = rpc.LeaseKeepAliveRequest(ID=lease_id)
        generation, member = self._member()
        try:
            with rpc_errors(f"lease keep-alive [{member.target}]"):
                async with member.lease.LeaseKeepAlive.open(timeout=timeout) as call:
                    await call.send(req)
                    reply = await call.recv()
        except StoreError as exc:
            self._failed(generation, exc.__cause__ or exc)
            raise
        return 0 if reply is None else int(reply.TTL)

    # -- watches --------------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> Watch:
        """Events under ``prefix`` from ``start_revision`` (default: changes after the watch starts,
        i.e. after ``async with`` or the first ``anext``)."""
        return Watch(self, (KeyRange.under(prefix),), start_revision)

    def watch_ranges(self, ranges: list[KeyRange] | tuple[KeyRange, ...], *,
                     start_revision: int | list[int] | None = None) -> Watch:
        """Events in any of ``ranges`` (one etcd watcher each, all on one stream), from ``start_revision``
        (one for all, or one per range); events of one range come in revision order."""
        return Watch(self, ranges, start_revision)

    def _range_keys(self, r: KeyRange) -> tuple[bytes, bytes]:
        k = self._k(r.start)
        if r.prefix:
            return k, prefix_end(k)
        return k, (self._k(r.end) if r.end is not None else b"")

    async def _watch_stream(self, ranges: Sequence[KeyRange], start_revisions: Sequence[int],
                            ) -> AsyncGenerator[tuple[int, list[WatchEvent], bool, int], None]:
        """One gRPC watch stream with one etcd watcher per range of ``ranges`` (watch id = index + 1), each
        from its start revision, for :class:`Watch`: yields (range index, events, created, header revision)
        per response until the stream fails. Raises ``Compacted`` if etcd compacted past a start revision,
        ``StoreError`` for anything else. Close it (``contextlib.aclosing``) to cancel the stream."""
        creates = []
        for i, (r, start) in enumerate(zip(ranges, start_revisions, strict=True)):
            key, end = self._range_keys(r)
            creates.append(rpc.WatchCreateRequest(key=key, range_end=end, start_revision=start,
                                                  progress_notify=True, watch_id=i + 1))
        what = f"watch {ranges[0]}" + (f" (+{len(ranges) - 1} ranges)" if len(ranges) > 1 else "")
        generation, member = self._member()
        try:
            with rpc_errors(f"{what} [{member.target}]"):
                # our half of the stream stays open (no end): etcd ends it only when we reset it
                async with member.watch.Watch.open(metadata=_WATCH_MD) as call:
                    for create in creates:
                        await call.send(rpc.WatchRequest(create_request=create))
                    async for resp in call:
                        if resp.compact_revision:
                            raise Compacted(int(resp.compact_revision))
                        if resp.canceled:
                            raise StoreError(f"watch canceled by etcd: {resp.cancel_reason}")
                        i = int(resp.watch_id) - 1
                        if not 0 <= i < len(ranges):
                            continue  # not one of ours (cannot happen with explicit ids; never index by it)
                        yield i, self._events(resp.events), bool(resp.created), int(resp.header.revision)
        except StoreError as exc:
            self._failed(generation, exc.__cause__ or exc)  # the next stream goes to the next member
            raise

    def _events(self, raw: Any) -> list[WatchEvent]:
        events: list[WatchEvent] = []
        for ev in raw:
            kind: Literal["put", "delete"] = "delete" if ev.type == rpc.Event.DELETE else "put"
            key = self._rel(ev.kv.key)
            value = _read_value(key, ev.kv.value) if kind == "put" else None
            events.append(WatchEvent(kind, key, value, int(ev.kv.mod_revision), len(ev.kv.key) + len(ev.kv.value)))
        return events

    # -- lifecycle ------------------------------------------------------------------------------
    async def close(self) -> None:
        await self.stop()

    async def _stop(self) -> None:
        for w in list(self._watches):
            await w.close()
        for lease in list(self._leases):
            # Revoking makes this process's leased keys vanish now rather than a TTL later.
            with contextlib.suppress(StoreError, TimeoutError):
                async with asyncio.timeout(min(self.timeout, 2.0)):
                    await lease.revoke()
        await self._channels.close()

    def __repr__(self) -> str:
        return f"Store({self.url}, prefix={self.prefix!r}, {self.state.value})"
