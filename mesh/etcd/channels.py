"""Channels to the members of an etcd cluster (gRPC on grpclib, :mod:`mesh.etcd.wire`), and which member
requests go to now.

Failover is done here rather than by gRPC's own load balancing over a multi-address target
(``ipv4:a:1,b:2`` with ``pick_first``/``round_robin``) because:

- a gRPC balancer moves off a member only when its *connection* fails; an etcd member that is up but
  has lost its leader (the moment the leader dies, or a member cut off from the quorum) keeps a healthy
  connection and answers ``UNAVAILABLE: etcdserver: no leader`` / ``request timed out``: the store must
  move on for those too;
- ``ipv4:``/``ipv6:`` targets take address literals only, while members are named by host names; and
  with TLS each member's certificate is checked against the name used to dial *that* member.

So there is one channel per member, opened lazily and kept open (a dead member's channel connects again on
the next request to it, at once: no back-off to wait out); requests go to the *current* member; a
request that fails with ``UNAVAILABLE`` or times out moves the store to the next member
(:meth:`Channels.failover`), once per failure (a generation number stops fifty concurrent requests
failing on one dead member from moving fifty times). :meth:`Channels.call` then retries the request on
the next member when that is safe (reads, puts, deletes, lease calls; never a txn whose fate is unknown),
until the request's timeout is spent; each attempt gets a share of it, so a black-holed member cannot
eat it all. Watches and keep-alives (streams) fail over too; their owners retry.

TLS: each member's certificate is checked against the CA and the name dialled; the client certificate, where
given, is presented (:func:`mesh.etcd.wire.client_context`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from mesh.backoff import Backoff
from mesh.errors import StoreError, StoreUnavailable
from mesh.etcd.endpoints import EtcdEndpoints
from mesh.etcd.wire import RpcError, Service, StatusCode, WireChannel
from mesh.log import get_logger, kv

__all__ = ["DOWN_CODES", "FAILOVER_CODES", "RECONNECT_GRACE_S", "Channels", "Member",
           "StorePermissionDenied", "connection_lost", "not_sent", "rpc_errors", "tls_hint", "translate"]

log = get_logger("mesh.etcd")
T = TypeVar("T")

# how long a request to a single member that could not connect is tried again
RECONNECT_GRACE_S = 1.5
DOWN_CODES = {StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED, StatusCode.CANCELLED}
# a member that answers these is dead, unreachable, or has no leader: try the next one
FAILOVER_CODES = {StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED}


class StorePermissionDenied(StoreError):
    """etcd refused the request under RBAC: the identity (the client certificate's CN, under
    ``--client-cert-auth``) has no role that permits it (see :mod:`mesh.etcd.rbac`)."""


def translate(exc: BaseException, what: str) -> StoreError:
    """A gRPC failure as the store's error (``StoreUnavailable`` when etcd looks down,
    ``StorePermissionDenied`` when RBAC refused it)."""
    if isinstance(exc, RpcError):
        if exc.code() == StatusCode.PERMISSION_DENIED:
            return StorePermissionDenied(f"{what}: permission denied by etcd RBAC ({exc.details()}): the client "
                                         f"certificate's identity may not do this")
        cls = StoreUnavailable if exc.code() in DOWN_CODES else StoreError
        return cls(f"{what}: {exc.code().name}: {exc.details()}")
    if isinstance(exc, TimeoutError):
        return StoreUnavailable(f"{what}: timed out")
    return StoreError(f"{what}: {exc!r}")


def not_sent(exc: RpcError) -> bool:
    """The request never reached a member (no connection), so even a txn may be sent again."""
    return exc.code() == StatusCode.UNAVAILABLE and "failed to connect" in (exc.details() or "").lower()


def connection_lost(exc: RpcError) -> bool:
    """The connection ended while the request was out (etcd restarted, a bound reset it): it may have been carried
    out, so only an idempotent request is sent again."""
    details = (exc.details() or "").lower()
    return exc.code() == StatusCode.UNAVAILABLE and details.startswith("connection to ") and " lost" in details


def tls_hint(details: str, endpoints: EtcdEndpoints) -> str:
    """What a refused connection's details suggest about TLS or etcd's auth (empty when nothing)."""
    low = details.lower()
    if "user name is empty" in low:  # etcd's answer to a request with no user while its auth (RBAC) is on
        return (" (etcd has authentication on and this client presented no user: connect over https:// with the "
                "client certificate of an etcd user: --etcd-ca, --etcd-cert, --etcd-key)")
    tlsish = any(w in low for w in ("ssl", "tls", "handshake", "certificate", "socket closed",
                                    "connection reset", "end of tcp stream", "connection lost"))
    if endpoints.tls is None and tlsish:
        return " (TLS? the member may require https:// with --etcd-ca and a client certificate)"
    if endpoints.tls is not None and tlsish:
        auth = "with" if endpoints.tls.client_auth else "without"
        return (f" (TLS handshake failed {auth} a client certificate: check --etcd-ca, --etcd-cert, "
                f"--etcd-key and that the member speaks TLS)")
    return ""


@contextlib.contextmanager
def rpc_errors(what: str) -> Iterator[None]:
    try:
        yield
    except (RpcError, TimeoutError) as exc:
        raise translate(exc, what) from exc


@dataclass(slots=True)
class Member:
    """One member's channel and its services."""

    target: str
    channel: WireChannel
    kv: Any
    lease: Any
    watch: Any
    auth: Any


class Channels:
    """The members of one cluster; ``current()`` is where requests go until ``failover``."""

    def __init__(self, endpoints: EtcdEndpoints) -> None:
        self.endpoints = endpoints
        self._members: dict[int, Member] = {}
        self._index = 0
        self.generation = 0  # bumped by every move to another member
        self.closed = False

    def __len__(self) -> int:
        return len(self.endpoints.targets)

    @property
    def target(self) -> str:
        return self.endpoints.targets[self._index]

    def _open(self, target: str) -> Member:
        channel = WireChannel(target, self.endpoints.tls)
        return Member(target, channel, Service(channel, "KV"), Service(channel, "Lease"), Service(channel, "Watch"),
                      Service(channel, "Auth"))

    def current(self) -> tuple[int, Member]:
        """(generation, member) to send the next request to."""
        member = self._members.get(self._index)
        if member is None:
            member = self._members[self._index] = self._open(self.endpoints.targets[self._index])
        return self.generation, member

    def failover(self, generation: int, reason: str) -> bool:
        """Move to the next member if the failure seen under ``generation`` is news; True if moved."""
        if generation != self.generation or len(self) == 1:
            return False
        old = self.target
        self._index = (self._index + 1) % len(self)
        self.generation += 1
        log.info("etcd member %s failing; now using %s", old, self.target,
                 extra=kv(event="etcd_failover", reason=reason[:200]))
        return True

    def use(self, index: int) -> None:
        """Make member ``index`` current (connect's first probe picks the first that answers)."""
        if index != self._index:
            self._index = index
            self.generation += 1

    def failed(self, generation: int, exc: BaseException) -> None:
        """A request to the member of ``generation`` failed: move on if the member looks down."""
        if isinstance(exc, RpcError) and exc.code() in FAILOVER_CODES:
            self.failover(generation, f"{exc.code().name}: {exc.details()}")
        elif isinstance(exc, TimeoutError):
            self.failover(generation, "timed out")

    async def call(self, what: str, call: Callable[[Member, float], Awaitable[T]], timeout: float, *,  # noqa: ASYNC109
                   idempotent: bool = True) -> T:
        """``call(member, attempt_timeout)`` on the current member; with several members, on failure
        the next one, until ``timeout`` is spent (a non-idempotent call only if it was never sent).
        Raises the store's errors."""
        started = time.monotonic()
        deadline = started + timeout
        n = len(self)
        # one slow member must leave time for the others
        attempt_s = timeout if n == 1 else max(timeout / n, 1.0)
        pause: Backoff | None = None  # made on the first failure: a call that succeeds pays nothing for it
        while True:
            if self.closed:
                raise StoreError("store is closed")
            generation, member = self.current()
            remaining = deadline - time.monotonic()
            try:
                return await call(member, max(min(attempt_s, remaining), 0.05))
            except RpcError as exc:
                self.failed(generation, exc)
                pause = pause or Backoff(0.05, 0.3)
                now = time.monotonic()
                # one member: only a request that never left (or an idempotent one whose connection was reset),
                # and only briefly, so a restarted etcd is waited for but a dead one is reported soon
                resend = not_sent(exc) or (idempotent and connection_lost(exc))
                may_retry = n > 1 or (resend and now - started < RECONNECT_GRACE_S)
                again = (may_retry and exc.code() in FAILOVER_CODES and (idempotent or not_sent(exc))
                         and deadline - now > 0.1)
                if not again:
                    raise translate(exc, f"{what} [{member.target}]") from exc
                # a leader election takes about a second: do not spin through the members meanwhile
                await asyncio.sleep(pause.next())

    async def close(self) -> None:
        self.closed = True
        members, self._members = self._members, {}
        for m in members.values():
            m.channel.close()
        if members:
            await asyncio.sleep(0)  # a loop turn for the transports to let go of their sockets
