"""``SiteDataPlane``: how one site serves a query — validate, decide, run locally or forward.

The decision is the scheduler's pure routing policy over the agent's cached view (no etcd on the
query path). A forwarded query carries the decision (target site and variant) so the next hop
serves it rather than re-routing; a hop that finds itself in the hop list refuses (loop). When a
forwarded hop fails (peer gone, overloaded), the query is re-decided without that site while its
deadline allows, else answered with the error in time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from core_scheduler.policy.modes import Router
from core_scheduler.policy.routing import Decision, Query
from core_scheduler.state.view import MeshView
from edge_agent.demand import DemandMeter
from edge_agent.host import VariantHost
from mesh.errors import (
    DeadlineExceeded,
    NoRoute,
    Overloaded,
    PeerUnavailable,
    ProtocolError,
    UnknownTask,
    UnknownTenant,
)
from mesh.log import get_logger, kv
from mesh.types import DEFAULT_TENANT, InferRequest, InferResponse, TaskSignature, Timing, check_inputs
from mesh.zmq.client import ZmqClient

__all__ = ["SiteDataPlane"]

log = get_logger(__name__)
_RETRYABLE = (PeerUnavailable, Overloaded)
MAX_RETRIES = 2
PATH_ESTIMATE_DECAY_S = 20.0  # an unused path's learnt overhead halves in ~14 s


class SiteDataPlane:
    def __init__(self, site: str, view: MeshView, host: VariantHost, zmq: ZmqClient, *,
                 table: Callable[[], Router | None], peer_endpoint: Callable[[str], str | None],
                 demand: DemandMeter) -> None:
        self.site = site
        self.view = view
        self.host = host
        self.zmq = zmq
        self._table = table
        self._peer_endpoint = peer_endpoint
        self.demand = demand
        self.inflight = 0
        self.served = 0
        self.forwarded = 0
        # observed path overhead beyond the topology's RTT, per destination: (mean, mean deviation,
        # when last observed), as TCP estimates its retransmission timeout; routing adds
        # mean + 2 x deviation, decaying while a path goes unused so that one bad spell (a
        # connection set-up, a burst) does not keep routing away from it for ever
        self.path_overhead: dict[str, tuple[float, float, float]] = {}
        # measured network round trip per destination (ms, moving average): half of it is kept
        # back from the budget a forward carries
        self.net_rtt_ms: dict[str, float] = {}

    # -- DataPlane protocol ----------------------------------------------------------------
    def ready(self) -> bool:
        return self._table() is not None and bool(self.view.signatures)

    def tasks(self) -> list[str]:
        return sorted(t for t in self.view.signatures if self.view.variants.get(t))

    def task_signature(self, task: str) -> TaskSignature:
        sig = self.view.signatures.get(task)
        if sig is None:
            raise UnknownTask(f"unknown task {task!r}; known: {self.tasks()}")
        return sig

    async def infer(self, req: InferRequest) -> InferResponse:
        """The data plane's door. ``req`` comes with its id and deadline, set where it entered the
        mesh (``InferRequest.entering``) and checked on arrival by its transport; its SLO checked
        itself. Its inputs are checked here, once per hop: later stages trust them."""
        received = time.monotonic()
        self._check_tenant(req.tenant)
        sig = self.task_signature(req.task)
        req.inputs = check_inputs(sig.inputs, req.inputs)
        if self.site in req.hops:
            raise ProtocolError(f"routing loop: {self.site} already in hops {req.hops}")
        req.hops = [*req.hops, self.site]
        self.inflight += 1
        try:
            if req.target_site == self.site and req.target_variant:
                return await self._serve_local(req, req.target_variant, "forwarded", False, received)
            if len(req.hops) == 1:
                self.demand.record(req.task, req.slo, time.monotonic(), req.tenant)
            return await self._route(req, received)
        finally:
            self.inflight -= 1

    # -- internals -------------------------------------------------------------------------
    def _check_tenant(self, tenant: str) -> None:
        topo = self.view.topology
        if tenant == DEFAULT_TENANT or topo is None:
            return
        if tenant not in topo.tenants:
            raise UnknownTenant(f"unknown tenant {tenant!r}")

    async def _route(self, req: InferRequest, received: float) -> InferResponse:
        table = self._table()
        if table is None:
            raise NoRoute(f"{self.site} has no routing state yet")
        excluded: set[str] = set()
        nbytes = sum(a.nbytes for a in req.inputs.values())
        last_error: Exception | None = None
        for _attempt in range(MAX_RETRIES + 1):
            remaining = req.remaining_ms()
            if remaining <= 0:
                break
            decision = table.decide(Query.from_slo(req.task, req.tenant, req.slo, remaining, nbytes,
                                                   frozenset(excluded)))
            try:
                if decision.site == self.site:
                    return await self._serve_local(req, decision.variant_id, decision.reason,
                                                   decision.best_effort, received)
                return await self._forward(req, decision, received)
            except _RETRYABLE as exc:
                last_error = exc
                excluded.add(decision.site)
                log.info("retrying without %s: %s", decision.site, exc,
                         extra=kv(site=self.site, request_id=req.request_id, tenant=req.tenant,
                                  reason="retry"))
                table = self._table() or table
        if last_error is not None:
            raise last_error
        raise DeadlineExceeded(f"request {req.request_id}: deadline passed while routing")

    def _observe_path(self, site: str, excess_ms: float) -> None:
        """Fold one observation of (actual - predicted) network time into the site's estimate."""
        excess = max(0.0, excess_ms)
        mean, dev, _ = self.path_overhead.get(site, (excess, excess / 2, 0.0))
        dev = 0.75 * dev + 0.25 * abs(excess - mean)
        mean = 0.875 * mean + 0.125 * excess
        self.path_overhead[site] = (mean, dev, time.monotonic())

    def rtt_correction(self, now: float | None = None) -> dict[str, float]:
        now = time.monotonic() if now is None else now
        return {s: (mean + 2 * dev) * math.exp(-max(0.0, now - seen) / PATH_ESTIMATE_DECAY_S)
                for s, (mean, dev, seen) in self.path_overhead.items()}

    async def _serve_local(self, req: InferRequest, variant_id: str, reason: str, best_effort: bool,
                           received: float) -> InferResponse:
        meta = self.view.variant(req.task, variant_id)
        if meta is None:
            raise NoRoute(f"{self.site}: variant {variant_id} of {req.task} not in catalog")
        if meta.owner not in (DEFAULT_TENANT, req.tenant):
            raise UnknownTask(f"task {req.task!r} has no variant {variant_id!r} for tenant {req.tenant!r}")
        lv = await self.host.ensure(meta)
        lv.last_used = time.monotonic()
        result = await lv.batcher.submit(req.inputs, req.deadline)
        self.served += 1
        total = (time.monotonic() - received) * 1000.0
        return InferResponse(
            request_id=req.request_id, outputs=result.outputs, site=self.site, variant=variant_id,
            accuracy=meta.accuracy, reason=reason, best_effort=best_effort, tenant=req.tenant,
            timing=Timing(network_ms=0.0, queue_ms=result.queue_ms, compute_ms=result.compute_ms,
                          total_ms=total),
            hops=req.hops)

    async def _forward(self, req: InferRequest, d: Decision, received: float) -> InferResponse:
        endpoint = self._peer_endpoint(d.site)
        if endpoint is None:
            raise PeerUnavailable(f"{d.site} has no live endpoint")
        fwd = InferRequest(task=req.task, inputs=req.inputs, slo=req.slo, tenant=req.tenant,
                           request_id=req.request_id, deadline=req.deadline, hops=req.hops,
                           target_site=d.site, target_variant=d.variant_id)
        self.forwarded += 1
        sent = time.monotonic()
        # keep back half the round trip measured to that peer: the forward transit, which the peer
        # cannot see (its deadline is its arrival plus the budget sent; see mesh.zmq.protocol)
        resp = await self.zmq.request(endpoint, fwd, reserve_ms=self.net_rtt_ms.get(d.site, 0.0) / 2)
        now = time.monotonic()
        total = (now - received) * 1000.0
        remote = resp.timing
        network = max(0.0, total - remote.total_ms)
        rtt = max(0.0, (now - sent) * 1000.0 - remote.total_ms)
        prev = self.net_rtt_ms.get(d.site)
        self.net_rtt_ms[d.site] = rtt if prev is None else 0.875 * prev + 0.125 * rtt
        self._observe_path(d.site, network - d.expected_latency_ms + remote.total_ms)
        resp.timing = Timing(network_ms=network, queue_ms=remote.queue_ms,
                             compute_ms=remote.compute_ms, total_ms=total)
        resp.reason, resp.best_effort = d.reason, d.best_effort
        return resp
