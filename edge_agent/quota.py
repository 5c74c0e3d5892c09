"""Tenant quotas at this agent's door: a token bucket (queries/s) and an in-flight count per tenant.

What each door enforces, and how a tenant's global ``qps`` is shared between doors, is the pure
policy :func:`core_scheduler.policy.quota.door_limits`; this module applies its answer. The agent
re-computes the limits from its cluster view on every view change (:meth:`DoorQuotas.update`);
buckets keep their tokens across updates, so a new share takes effect without a free refill.

Only queries entering the mesh here are charged (``SiteDataPlane.infer`` calls :meth:`admit` for a
query that arrives with no hops, whichever transport brought it: HTTP, the in-process SDK, a ZeroMQ
caller that is not a site); a hop forwarded from another site was charged at its door. A hop list is
believed only from an authenticated site once site-to-site CURVE is in place (issue 11, item 3); until
then a ZeroMQ caller that claims hops escapes the charge, as it escapes every other tenant check.
Over quota raises :class:`mesh.errors.QuotaExceeded` (HTTP 429) with ``retry_after_s``: whole
seconds until a token is available (at least 1, at most :data:`MAX_RETRY_AFTER_S`); 1 for an
in-flight refusal, whose slot frees when some query finishes. Tenants without quotas (and tenants
the topology does not name, which the data plane refuses or lets through as before) pass.
Time is passed in (``clock``), so tests drive it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from core_scheduler.policy.quota import QuotaLimit, door_limits
from core_scheduler.state.heartbeat import Heartbeat
from mesh import clock as mesh_clock
from mesh.errors import QuotaExceeded

__all__ = ["MAX_RETRY_AFTER_S", "DoorQuotas", "TokenBucket", "limits_from_view"]

# Retry-After for a tenant whose rate is 0 (never refills): a finite, polite answer
MAX_RETRY_AFTER_S = 60


def limits_from_view(here: str, quotas: Mapping[str, Mapping[str, float]],
                     live: Mapping[str, Heartbeat]) -> dict[str, QuotaLimit]:
    """This door's limits from the topology's tenant quotas and the live sites' heartbeats: each
    site's door demand per tenant is the sum of its ``DemandSample`` records for that tenant."""
    demand: dict[str, dict[str, float]] = {}
    for site, hb in live.items():
        per = demand.setdefault(site, {})
        for d in hb.demand:
            per[d.tenant] = per.get(d.tenant, 0.0) + d.qps
    return door_limits(here, live.keys(), quotas, demand)


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
        held = self.inflight.get(tenant, 0)
        if lim.max_inflight is not None and held >= lim.max_inflight:
            self._refuse(tenant, f"tenant {tenant!r} has {held} queries in flight at this door "
                                 f"(limit {lim.max_inflight})", 1, "max_inflight")
        bucket = self._buckets.get(tenant)
        if bucket is not None and (wait := bucket.take(self._clock())) > 0.0:
            after = MAX_RETRY_AFTER_S if math.isinf(wait) else min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait)))
            self._refuse(tenant, f"tenant {tenant!r} is over its rate at this door "
                                 f"({bucket.rate:.3g} queries/s)", after, "qps")
        self.inflight[tenant] = held + 1

    def release(self, tenant: str) -> None:
        left = self.inflight.get(tenant, 0) - 1
        if left > 0:
            self.inflight[tenant] = left
        else:
            self.inflight.pop(tenant, None)

    def _refuse(self, tenant: str, message: str, retry_after_s: int, limit: str) -> None:
        self.refused[tenant] = self.refused.get(tenant, 0) + 1
        raise QuotaExceeded(message, retry_after_s=retry_after_s, tenant=tenant, limit=limit)
