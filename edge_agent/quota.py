"""Tenant quotas at this agent's door: a token bucket (queries/s) and an in-flight count per tenant.

What each door enforces, and how a tenant's global ``qps`` is shared between doors, is the pure
policy :func:`core_scheduler.policy.quota.door_limits`; this module applies its answer. The agent
re-computes the limits from its cluster view on every view change (:meth:`DoorQuotas.update`);
buckets keep their tokens across updates, so a new share takes effect without a free refill.

Only queries entering the mesh here are charged (``SiteDataPlane.infer`` calls :meth:`admit` for a
query that arrives with no hops, whichever transport brought it: HTTP, the in-process SDK, a ZeroMQ
caller that is not a site); a hop forwarded from another site was charged at its door.

A forwarded query is believed only from the door that admitted it (with CURVE, ``check_sender``: its hops are
exactly its authenticated sender), and that door may have lied about its tenant. So the site serving it holds
each door to what the door itself may admit (:class:`PeerQuotas`): per (door, tenant) the door's share of the
tenant's ``qps``, computed from this site's view as the door computes it from its own (with
:data:`PEER_HEADROOM` for views a heartbeat apart; a door outside this site's view gets the tenant's whole ``qps``:
its share is not known here) and the tenant's ``max_inflight``. A compromised site then spends at most its own
share of a tenant at each site it forwards to, and nothing of the tenant's quota at the other doors. Over it
raises ``Overloaded`` (the door routes elsewhere). The cold loads a peer causes here are bounded too
(:class:`PeerLoads`), so a compromised site cannot keep every site loading and evicting.

Over quota raises :class:`mesh.errors.QuotaExceeded` (HTTP 429) with ``retry_after_s``: whole
seconds until a token is available (at least 1, at most :data:`MAX_RETRY_AFTER_S`); 1 for an
in-flight refusal, whose slot frees when some query finishes. Tenants without quotas (and tenants
the topology does not name, which the data plane refuses or lets through as before) pass.
Time is passed in (``clock``), so tests drive it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from core_scheduler.policy.quota import QuotaLimit, clamp_demand, door_limits
from core_scheduler.state.heartbeat import Heartbeat
from mesh import clock as mesh_clock
from mesh.errors import Overloaded, QuotaExceeded

__all__ = ["MAX_RETRY_AFTER_S", "PEER_HEADROOM", "DoorQuotas", "PeerLoads", "PeerQuotas", "TokenBucket",
           "door_demand", "limits_from_view"]

# Retry-After for a tenant whose rate is 0 (never refills): a finite, polite answer
MAX_RETRY_AFTER_S = 60
# A site serving forwarded queries computes a door's share from its own view, which may be a heartbeat (and a
# debounce) apart from the door's: room for that, so an honest door is never refused for it
PEER_HEADROOM = 1.5
PEER_BURST_S = 2.0
# Cold loads one peer may cause here: a burst, then one per PEER_LOAD_EVERY_S. Placement loads what demand needs
# ahead of time (prewarm); a forwarded cold load is the exception (a new variant, a burst before placement
# follows), and a door refused one routes the query elsewhere (Overloaded is retried), while a compromised door
# can no longer keep a site loading and evicting.
PEER_LOAD_BURST = 4.0
PEER_LOAD_EVERY_S = 15.0
PEER_LOAD_MEMO_S = 60.0  # a peer's queries that find the load it paid for still running are not charged again


def door_demand(live: Mapping[str, Heartbeat]) -> dict[str, dict[str, float]]:
    """door -> tenant -> admitted qps: the sum of each live site's ``DemandSample`` records per tenant (samples
    that are not finite positive numbers count as none; the sum is clamped again by the policy)."""
    demand: dict[str, dict[str, float]] = {}
    for site, hb in live.items():
        per = demand.setdefault(site, {})
        for d in hb.demand:
            per[d.tenant] = per.get(d.tenant, 0.0) + clamp_demand(d.qps)
    return demand


def limits_from_view(here: str, quotas: Mapping[str, Mapping[str, float]],
                     live: Mapping[str, Heartbeat]) -> dict[str, QuotaLimit]:
    """This door's limits from the topology's tenant quotas and the live sites' heartbeats."""
    return door_limits(here, live.keys(), quotas, door_demand(live))


class TokenBucket:
    """``rate`` tokens/s up to ``burst``; starts full. Times are monotonic seconds."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate < 0 or burst < 0 or not math.isfinite(rate) or not math.isfinite(burst):
            raise ValueError(f"a token bucket needs finite rate >= 0 and burst >= 0, got {rate}, {burst}")
        self.rate, self.burst, self.tokens, self.stamp = rate, burst, burst, now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def take(self, now: float) -> float:
        """Take one token: 0.0 when taken, else the seconds until one will be there (``inf``: never)."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        if self.rate <= 0.0 or self.burst < 1.0:
            return math.inf
        return (1.0 - self.tokens) / self.rate

    def wait(self, now: float) -> float:
        """What :meth:`take` would answer, taking nothing."""
        self._refill(now)
        if self.tokens >= 1.0:
            return 0.0
        if self.rate <= 0.0 or self.burst < 1.0:
            return math.inf
        return (1.0 - self.tokens) / self.rate

    def reshape(self, rate: float, burst: float, now: float) -> None:
        """New rate and capacity; tokens already there stay (up to the new capacity)."""
        self._refill(now)
        self.rate, self.burst = rate, burst
        self.tokens = min(self.tokens, burst)


class DoorQuotas:
    """Per-tenant buckets and in-flight counts at one door."""

    def __init__(self, clock: Callable[[], float] = mesh_clock.monotonic) -> None:
        self._clock = clock
        self.limits: dict[str, QuotaLimit] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self.inflight: dict[str, int] = {}
        self.refused: dict[str, int] = {}

    def update(self, limits: Mapping[str, QuotaLimit]) -> None:
        now = self._clock()
        for tenant in list(self._buckets):
            lim = limits.get(tenant)
            if lim is None or lim.qps is None:
                del self._buckets[tenant]
        for tenant, lim in limits.items():
            if lim.qps is None:
                continue
            bucket = self._buckets.get(tenant)
            if bucket is None:
                self._buckets[tenant] = TokenBucket(lim.qps, lim.burst, now)
            else:
                bucket.reshape(lim.qps, lim.burst, now)
        self.limits = dict(limits)

    def admit(self, tenant: str) -> None:
        """Count one query of ``tenant`` in, or raise ``QuotaExceeded``. Pair with :meth:`release`."""
        lim = self.limits.get(tenant)
        if lim is None:
            self.inflight[tenant] = self.inflight.get(tenant, 0) + 1
            return
        self._check(tenant, lim, take=True)
        self.inflight[tenant] = self.inflight.get(tenant, 0) + 1

    def check(self, tenant: str) -> None:
        """Raise ``QuotaExceeded`` if :meth:`admit` would, charging nothing: the HTTP front asks before it reads a
        request's body, so an over-quota tenant costs no body read and no decode."""
        lim = self.limits.get(tenant)
        if lim is not None:
            self._check(tenant, lim, take=False)

    def _check(self, tenant: str, lim: QuotaLimit, *, take: bool) -> None:
        held = self.inflight.get(tenant, 0)
        if lim.max_inflight is not None and held >= lim.max_inflight:
            self._refuse(tenant, f"tenant {tenant!r} has {held} queries in flight at this door "
                                 f"(limit {lim.max_inflight})", 1, "max_inflight")
        bucket = self._buckets.get(tenant)
        if bucket is None:
            return
        now = self._clock()
        if (wait := bucket.take(now) if take else bucket.wait(now)) > 0.0:
            after = MAX_RETRY_AFTER_S if math.isinf(wait) else min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait)))
            self._refuse(tenant, f"tenant {tenant!r} is over its rate at this door "
                                 f"({bucket.rate:.3g} queries/s)", after, "qps")

    def release(self, tenant: str) -> None:
        left = self.inflight.get(tenant, 0) - 1
        if left > 0:
            self.inflight[tenant] = left
        else:
            self.inflight.pop(tenant, None)

    def _refuse(self, tenant: str, message: str, retry_after_s: int, limit: str) -> None:
        self.refused[tenant] = self.refused.get(tenant, 0) + 1
        raise QuotaExceeded(message, retry_after_s=retry_after_s, tenant=tenant, limit=limit)


def _with_headroom(lim: QuotaLimit) -> QuotaLimit:
    if lim.qps is None or lim.qps <= 0.0:
        return lim
    rate = lim.qps * PEER_HEADROOM
    return QuotaLimit(qps=rate, burst=max(lim.burst, rate * PEER_BURST_S), max_inflight=lim.max_inflight)


class PeerQuotas:
    """At a site serving forwarded queries: what each door may spend here of each tenant's quota (see the
    module docstring). A :class:`DoorQuotas` per door, its limits re-computed on the door's first query after
    each :meth:`update` (most sites forward to a few). Doors are authenticated sites: bounded by the topology."""

    def __init__(self, clock: Callable[[], float] = mesh_clock.monotonic) -> None:
        self._clock = clock
        self._quotas: dict[str, Mapping[str, float]] = {}
        self._live: frozenset[str] = frozenset()
        self._demand: dict[str, dict[str, float]] = {}
        self._doors: dict[str, DoorQuotas] = {}
        self._current: set[str] = set()  # doors whose limits follow the last update
        self.refused: dict[tuple[str, str], int] = {}

    def update(self, quotas: Mapping[str, Mapping[str, float]], live: Mapping[str, Heartbeat]) -> None:
        self._quotas, self._live, self._demand = dict(quotas), frozenset(live), door_demand(live)
        self._current.clear()

    def limits(self, door: str) -> dict[str, QuotaLimit]:
        """What ``door`` may spend here, per tenant with quotas."""
        if door in self._live:
            base = door_limits(door, self._live, self._quotas, self._demand)
        else:  # not in this site's view: its share is unknown here, and never more than the whole
            base = door_limits(door, (), self._quotas, {})
        return {tenant: _with_headroom(lim) for tenant, lim in base.items()}

    def admit(self, door: str, tenant: str) -> None:
        """Count one forwarded query of ``tenant`` from ``door`` in, or raise ``Overloaded``. Pair with
        :meth:`release`."""
        quotas = self._doors.get(door)
        if quotas is None:
            quotas = self._doors[door] = DoorQuotas(self._clock)
        if door not in self._current:
            quotas.update(self.limits(door))
            self._current.add(door)
        try:
            quotas.admit(tenant)
        except QuotaExceeded as exc:
            self.refused[(door, tenant)] = self.refused.get((door, tenant), 0) + 1
            raise Overloaded(f"site {door} is over its share of tenant {tenant!r} here: {exc.message}",
                             reason="door_share", door=door, tenant=tenant) from exc

    def release(self, door: str, tenant: str) -> None:
        quotas = self._doors.get(door)
        if quotas is not None:
            quotas.release(tenant)


class PeerLoads:
    """The cold loads each peer may cause at this site: a token bucket per peer (:data:`PEER_LOAD_BURST`, then one
    every :data:`PEER_LOAD_EVERY_S`). :meth:`charge` is called when a forwarded query finds its instance not
    loaded; the peer's queries that find that instance still loading within :data:`PEER_LOAD_MEMO_S` are not
    charged again."""

    def __init__(self, clock: Callable[[], float] = mesh_clock.monotonic, *, burst: float = PEER_LOAD_BURST,
                 every_s: float = PEER_LOAD_EVERY_S) -> None:
        self._clock, self._burst, self._rate = clock, burst, 1.0 / every_s
        self._buckets: dict[str, TokenBucket] = {}
        self._charged: dict[tuple[str, object], float] = {}  # (peer, instance) -> when charged
        self.refused: dict[str, int] = {}

    def charge(self, peer: str, instance: object) -> None:
        """One cold load of ``instance`` caused by ``peer``, or ``Overloaded`` when it has caused its share."""
        now = self._clock()
        at = self._charged.get((peer, instance))
        if at is not None and now - at < PEER_LOAD_MEMO_S:
            return
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = self._buckets[peer] = TokenBucket(self._rate, self._burst, now)
        if bucket.take(now) > 0.0:
            self.refused[peer] = self.refused.get(peer, 0) + 1
            raise Overloaded(f"site {peer} has caused its share of cold loads here ({self._burst:.0f}, then one "
                             f"every {1.0 / self._rate:.0f} s)", reason="peer_loads", peer=peer)
        if len(self._charged) >= 4096:  # bounded: what is past the memo window is forgotten
            self._charged = {k: t for k, t in self._charged.items() if now - t < PEER_LOAD_MEMO_S}
        self._charged[(peer, instance)] = now
