"""``SiteDataPlane``: how one site serves a query — validate, decide, run locally or forward.

The decision is the scheduler's pure routing policy over the agent's cached view (no etcd on the
query path). A forwarded query carries the decision (target site and variant) so the next hop
serves it rather than re-routing; a hop that finds itself in the hop list refuses (loop).

Forwarding is one hop: the door decides, and the site it forwards to serves (a forwarded query is never
forwarded again; a retry is the door's, to another site). So with CURVE the authenticated sender of a
forwarded query is its door (:func:`check_sender`), and the serving site holds that door to its own share of
the tenant's quota and bounds the cold loads it causes (:mod:`edge_agent.quota`).

Failures. Sites whose ZeroMQ endpoint the transport has marked unreachable (heartbeats gone
silent, :mod:`mesh.zmq.client`) are left out of every decision until a probe brings them back:
the routing policy gets them as ``Query.exclude_sites``. A variant that fails to load (its blob, the
site's disk or runtime) is retried at another site as a failed forward is; a load still running when
the query's deadline comes does not hold the query past it. A forward attempt may run for
``paths.attempt_ms`` (a multiple of what routing expected), not the whole budget, so that a path
which went dark before the heartbeats noticed costs only part of it. When an attempt fails (peer
gone, overloaded, abandoned at its limit) the query is re-decided without that site while its
deadline allows, never past it and never twice to the same site, else answered with the error in
time. A reply served after a failed attempt says so: its reason gets ``+retried`` appended
(``forward+retried``). Failed and timed-out forwards feed the learnt path overhead as successes
do (``paths.PathEstimates``), each from its own send, less this loop's own delay in getting to the answer
(``mesh.zmq.client.ReplyWait``): the door's stalls are not the path's.

Observability. The door counts every query it answers once (``edge_agent.metrics``: outcome, routing
reason, SLO met or missed, latency by component, and its own delay from the query's entry to its first routing
decision); the site that runs it counts it as served. The door measured the whole time: a reply's total is
from the query's entry, and a reply past its budget says so (``InferResponse.late``; best effort or not), so
no late answer passes for a met one. A traced
query (``traceparent`` set, by the caller's request or the door's sample) records each decision with
its candidates (``edge_agent.traces``) and returns each hop's records with the reply; the door keeps
the whole trace. Nothing of this is built for an untraced query.

Cascades. A decision for a cascade (``routing.CascadeDecision``) is run by :mod:`edge_agent.cascade_exec`: each
stage as a query this door serves or forwards pinned to the stage's (site, variant), as any decision; a traced
query records each stage as an event of the door's hop. A failed stage fails the query, named (no retry;
so a forwarded stage may use all that is left of the query's budget, not an attempt's share).

Pipelines. A query of a task declared as a graph of tasks (``view.pipelines``) is run at its door by
:mod:`edge_agent.pipeline_exec`: each stage sent back through :meth:`SiteDataPlane.infer` as an ordinary query of
its own task (admitted, routed and placed as any), fed by name; a failed stage fails the query, named.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from core_scheduler.policy.modes import Router
from core_scheduler.policy.routing import CascadeDecision, Decision, Query
from core_scheduler.policy.routing_cascade import CascadePlan
from core_scheduler.state.view import MeshView
from edge_agent.cascade_exec import door_runner, run_cascade
from edge_agent.dataplane import task_visible
from edge_agent.demand import DemandMeter
from edge_agent.host import VariantHost
from edge_agent.metrics import AgentMetrics
from edge_agent.paths import PathEstimates, attempt_ms
from edge_agent.pipeline_exec import run_pipeline, stage_latency_ms
from edge_agent.quota import DoorQuotas, PeerLoads, PeerQuotas
from edge_agent.traces import HopTrace, TraceStore, clean_hops, sampled
from mesh.errors import (
    BlobError,
    DeadlineExceeded,
    MeshError,
    NoRoute,
    Overloaded,
    PeerUnavailable,
    PermissionDenied,
    ProtocolError,
    RuntimeLoadError,
    Unauthenticated,
    UnknownTask,
    UnknownTenant,
)
from mesh.log import get_logger, kv
from mesh.tracecontext import child_traceparent, new_traceparent, trace_id_of
from mesh.types import (
    BEST_EFFORT_GRACE_MS,
    DEFAULT_TENANT,
    InferRequest,
    InferResponse,
    TaskSignature,
    Timing,
    check_inputs,
)
from mesh.zmq.client import ReplyWait, ZmqClient
from mesh.zmq.server import current_peer

__all__ = ["SiteDataPlane", "check_sender"]

log = get_logger(__name__)
MAX_RETRIES = 2
RETRIED = "+retried"  # appended to the reason of a reply served after a failed attempt


class AttemptTimedOut(DeadlineExceeded):
    """A forward abandoned at its attempt limit while the query still has budget: retryable."""


# a load that failed at one site (its blob, its disk, its runtime) says nothing about the others
_RETRYABLE = (PeerUnavailable, Overloaded, AttemptTimedOut, RuntimeLoadError, BlobError)


def check_sender(req: InferRequest, peer: str | None, *, secured: bool, here: str | None = None) -> None:
    """Where a query came from over ZeroMQ decides whether its header is believed. With CURVE on
    (``secured``), its tenant, target and hops are trusted only from an authenticated site, and only as what
    forwarding in this mesh is: one hop, from the door that admitted it (its hops are exactly ``[peer]``: binding
    only the last hop let any site claim any door, and so escape every door's quota), to a variant served here
    (``target_site`` is ``here``, with its ``target_variant``; None: not checked)."""
    if not secured:
        return
    if peer is None:
        raise Unauthenticated(f"request {req.request_id}: the sender is not an authenticated site; its "
                              f"tenant and target claims are not trusted", reason="not_a_site")
    if req.hops != [peer]:
        raise PermissionDenied(f"request {req.request_id} from site {peer} claims hops {req.hops}: a forwarded "
                               f"query comes from the door that admitted it", reason="hops")
    if here is not None and (req.target_site != here or not req.target_variant):
        raise PermissionDenied(f"request {req.request_id} from site {peer} names no variant to serve here "
                               f"(target {req.target_site}): forwarded queries are served, never forwarded "
                               f"again", reason="target")


class SiteDataPlane:
    def __init__(self, site: str, view: MeshView, host: VariantHost, zmq: ZmqClient, *,
                 table: Callable[[], Router | None], peer_endpoint: Callable[[str], str | None],
                 demand: DemandMeter, quota: DoorQuotas | None = None, metrics: AgentMetrics | None = None,
                 traces: TraceStore | None = None, trace_sample_rate: float = 0.0,
                 peer_quota: PeerQuotas | None = None) -> None:
        self.site = site
        self.view = view
        self.host = host
        self.zmq = zmq
        self._table = table
        self._peer_endpoint = peer_endpoint
        self.demand = demand
        self.secured = False  # CURVE on: forwarded queries are believed only from authenticated sites
        # tenant quotas, charged once per query at the door it entered by (no hops yet): here, not in
        # the HTTP front, so that every way in (HTTP, in-process SDK, a ZeroMQ caller) pays
        self.quota = quota if quota is not None else DoorQuotas()
        # with CURVE: what each door may spend here of its tenants' quotas, and the cold loads it may cause
        self.peer_quota = peer_quota if peer_quota is not None else PeerQuotas()
        self.peer_loads = PeerLoads()
        self.inflight = 0
        self.last_active = 0.0  # time.monotonic() when a query last ended here (see idle_s)
        self.served = 0
        self.forwarded = 0
        self.retried = 0  # queries served after a failed attempt
        # observed path overhead beyond the topology's RTT, per destination (see edge_agent.paths):
        # decaying while a path goes unused, so that one bad spell does not keep routing away for ever
        self.paths = PathEstimates()
        # the learnt corrections the routing table in force was built with (set by whoever builds it): a decision's
        # expected latency includes them, and a path's sample is measured against the plan without them
        self.table_correction: dict[str, float] = {}
        # endpoints the transport has marked unreachable, and the live sites behind them
        self._down_endpoints: set[str] = set()
        self.unreachable: frozenset[str] = frozenset()
        zmq.add_reachability_listener(self._on_reachability)
        # measured network round trip per destination (ms, moving average): half of it is kept
        # back from the budget a forward carries
        self.net_rtt_ms: dict[str, float] = {}
        self.metrics = metrics if metrics is not None else AgentMetrics(site)
        self.traces = traces if traces is not None else TraceStore()
        # share of queries traced without asking (drawn at the door; 0: only those that ask)
        self.trace_sample_rate = trace_sample_rate

    # -- DataPlane protocol ----------------------------------------------------------------
    def ready(self) -> bool:
        return self._table() is not None and bool(self.view.signatures)

    def tasks(self) -> list[str]:
        return sorted({*(t for t in self.view.signatures if self.view.variants.get(t)), *self.view.pipelines})

    def task_signature(self, task: str) -> TaskSignature:
        sig = self.view.signatures.get(task)
        if sig is None and task in self.view.pipelines:
            return self.view.pipelines[task].signature
        if sig is None:  # no list of the tasks there are: it would name other tenants' private ones
            raise UnknownTask(f"unknown task {task!r}")
        return sig

    def visible(self, task: str, tenant: str) -> bool:
        """Whether ``tenant`` may know of ``task`` (:func:`edge_agent.dataplane.task_visible` over its variants'
        owners; a pipeline's own owner)."""
        if task not in self.view.signatures and task in self.view.pipelines:
            return self.view.pipelines[task].owner in (DEFAULT_TENANT, tenant)
        return task_visible((m.owner for m in (self.view.variants.get(task) or {}).values()), tenant)

    async def infer(self, req: InferRequest) -> InferResponse:
        """The data plane's door. ``req`` comes with its id and deadline, set where it entered the
        mesh (``InferRequest.entering``) and checked on arrival by its transport; its SLO checked
        itself. Its inputs are checked here, once per hop: later stages trust them."""
        if not req.hops and req.task not in self.view.signatures and req.task in self.view.pipelines:
            return await self._pipeline(req)
        received = time.monotonic()
        door = not req.hops
        budget_end = req.deadline  # before a best-effort grace: a reply after it is late (door_late)
        hop: HopTrace | None = None
        if req.traceparent is not None or (door and self.trace_sample_rate > 0.0
                                           and sampled(self.trace_sample_rate)):
            hop = self._trace_hop(req, door)
        try:
            self._check_tenant(req.tenant)
            if door and not self.visible(req.task, req.tenant):
                raise UnknownTask(f"unknown task {req.task!r}")  # another tenant's private task: as if none
            sig = self.task_signature(req.task)
            req.inputs = check_inputs(sig.inputs, req.inputs)
            if self.site in req.hops:
                raise ProtocolError(f"routing loop: {self.site} already in hops {req.hops}")
            if door:
                self.quota.admit(req.tenant)  # raises QuotaExceeded
            # with CURVE the sender is the door (check_sender): held to its share of the tenant here
            sender = req.hops[0] if self.secured and not door else None
            if sender is not None:
                self.peer_quota.admit(sender, req.tenant)  # raises Overloaded
            req.hops = [*req.hops, self.site]
            self.inflight += 1
            try:
                if req.target_site == self.site and req.target_variant:
                    resp = await self._serve_local(req, req.target_variant, "forwarded", False, received, hop,
                                                   sender=sender)
                else:
                    if len(req.hops) == 1:
                        self.demand.record(req.task, req.slo, time.monotonic(), req.tenant, req.rows)
                    resp = await self._route(req, received, hop)
            finally:
                self.inflight -= 1
                self.last_active = time.monotonic()
                if door:
                    self.quota.release(req.tenant)
                elif sender is not None:
                    self.peer_quota.release(sender, req.tenant)
        except Exception as exc:
            if door:
                self._door_failed(req, exc, hop)
            raise
        if door:
            self._door_late(req, resp, budget_end)
        if hop is not None:
            hop.timed(resp.timing, late=resp.late)
            resp.trace = [*hop.records, *clean_hops(resp.trace)]
        if door:
            self.metrics.door_ok(req.task, req.tenant, req.slo, resp)
            if hop is not None:
                self.traces.add(req.request_id, trace_id_of(req.traceparent or ""), req.tenant, req.task, "ok",
                                resp.trace or [])
        return resp

    @staticmethod
    def _door_late(req: InferRequest, resp: InferResponse, budget_end: float) -> None:
        """The door measured the whole time, from the query's entry (its deadline less its SLO's budget) to its
        answer: that is the reply's total, and a reply past its budget says so (``late``), best effort or not.
        Never silently met: the SDK, tritonclient's parameters and the SLO metrics all read it from here."""
        whole = (time.monotonic() - budget_end) * 1000.0 + req.slo.latency_ms
        if whole > resp.timing.total_ms:
            resp.timing.total_ms = whole
        resp.late = whole > req.slo.latency_ms

    def _trace_hop(self, req: InferRequest, door: bool) -> HopTrace:
        if req.traceparent is None:
            req.traceparent = new_traceparent()
        if door:
            return HopTrace(self.site, "edge")
        return HopTrace(self.site, "serve" if req.target_site == self.site and req.target_variant else "forward")

    def _door_failed(self, req: InferRequest, exc: Exception, hop: HopTrace | None) -> None:
        code = exc.code if isinstance(exc, MeshError) else "internal"
        self.metrics.door_error(req.task, req.tenant, code, req.slo)
        # only a query admitted (the door adds itself to its hops right after the quota) leaves a trace: one
        # refused before (tenant, task, inputs, quota) decided nothing, and a refused caller could pile them up
        if hop is not None and req.hops:
            hop.failed(code)
            self.traces.add(req.request_id, trace_id_of(req.traceparent or ""), req.tenant, req.task, code,
                            hop.records)

    def idle_s(self) -> float:
        """Seconds since a query last ended here; 0 while one is in flight."""
        return 0.0 if self.inflight else time.monotonic() - self.last_active

    async def infer_from_peer(self, req: InferRequest) -> InferResponse:
        """The ZeroMQ server's handler: :meth:`infer` for a query another site forwarded."""
        check_sender(req, current_peer(), secured=self.secured, here=self.site)
        return await self.infer(req)

    # -- internals -------------------------------------------------------------------------
    def _check_tenant(self, tenant: str) -> None:
        topo = self.view.topology
        if tenant == DEFAULT_TENANT or topo is None:
            return
        if tenant not in topo.tenants:
            raise UnknownTenant(f"unknown tenant {tenant!r}")

    def _strict(self, tenant: str) -> bool:
        topo = self.view.topology
        t = topo.tenants.get(tenant) if topo is not None else None
        return t is not None and t.isolation == "strict"

    def _on_reachability(self, endpoint: str, down: bool) -> None:
        if down:
            self._down_endpoints.add(endpoint)
        else:
            self._down_endpoints.discard(endpoint)
        self.unreachable = frozenset(s for s in self.view.live if s != self.site
                                     and self._peer_endpoint(s) in self._down_endpoints)
        log.log(logging.WARNING if down else logging.INFO, "%s %s; routing around: %s", endpoint,
                "unreachable" if down else "reachable again", sorted(self.unreachable),
                extra=kv(site=self.site, event="reachability"))

    async def _route(self, req: InferRequest, received: float, hop: HopTrace | None = None) -> InferResponse:
        table = self._table()
        if table is None:
            raise NoRoute(f"{self.site} has no routing state yet")
        excluded: set[str] = set()
        nbytes = sum(a.nbytes for a in req.inputs.values())
        rows = req.rows
        last_error: Exception | None = None
        for attempt in range(MAX_RETRIES + 1):
            remaining = req.remaining_ms()
            if not attempt and len(req.hops) == 1:
                # the door's own delay, from the query's entry to its first decision (a busy loop, a capped
                # CPU): counted as such, and never taken for an impossible SLO (routing judges that on the
                # whole budget asked, Query.slo_ms)
                door_ms = max(0.0, req.slo.latency_ms - remaining)
                self.metrics.door_delay(req.task, door_ms)
                if hop is not None:
                    hop.entered(door_ms)
            if remaining <= 0:
                break
            down = self.unreachable
            query = Query.from_slo(req.task, req.tenant, req.slo, remaining, nbytes,
                                   frozenset(excluded | down) if down else frozenset(excluded), rows, req.version)
            decision = table.decide(query)
            if decision.best_effort and not attempt:
                # nothing could meet the SLO: served late rather than not at all (edge_agent.paths);
                # the forward carries the extended budget, so the serving hop keeps it too. A retry
                # that turned best effort for want of time is not: retries never pass the deadline
                req.deadline += BEST_EFFORT_GRACE_MS / 1000.0
                remaining += BEST_EFFORT_GRACE_MS
            if hop is not None:
                hop.decided(table, query, decision)
            if isinstance(decision, CascadeDecision) and decision.plan is not None:
                return await self._cascade(req, decision.plan, hop)
            try:
                if decision.site == self.site:
                    resp = await self._serve_local(req, decision.variant_id, decision.reason,
                                                   decision.best_effort, received, None)
                else:
                    resp = await self._forward(req, decision, received, remaining)
            except _RETRYABLE as exc:
                last_error = exc
                if hop is not None:
                    hop.failed(exc.code)
                excluded.add(decision.site)
                log.info("retrying without %s: %s", decision.site, exc,
                         extra=kv(site=self.site, request_id=req.request_id, tenant=req.tenant,
                                  reason="retry"))
                table = self._table() or table
                continue
            if excluded:
                self.retried += 1
                resp.reason += RETRIED
            return resp
        if last_error is not None:
            raise last_error
        raise DeadlineExceeded(f"request {req.request_id}: deadline passed while routing")

    async def _cascade(self, req: InferRequest, plan: CascadePlan, hop: HopTrace | None) -> InferResponse:
        """Serve ``req`` by the cascade ``plan`` (:mod:`edge_agent.cascade_exec`), each stage run here or forwarded
        pinned to its (site, variant) as any decision is."""
        run = door_runner(self.site, req, hop,
                          local=lambda sub, variant: self._serve_local(sub, variant, "local", False, time.monotonic()),
                          forward=lambda sub, d: self._forward(sub, d, time.monotonic(), sub.remaining_ms()))
        resp = await run_cascade(plan, req.inputs, self.task_signature(req.task).outputs[0].name, run,
                                 request_id=req.request_id, tenant=req.tenant, hop=hop)
        self.metrics.cascade(req.task, resp)
        return resp

    async def _pipeline(self, req: InferRequest) -> InferResponse:
        """A query of a pipeline task at its door (:mod:`edge_agent.pipeline_exec`): each stage sent through
        :meth:`infer` as an ordinary query of its task; the pipeline counted and traced as one query besides."""
        budget_end = req.deadline
        meta = self.view.pipelines[req.task]
        try:
            self._check_tenant(req.tenant)
            if meta.owner not in (DEFAULT_TENANT, req.tenant):
                raise UnknownTask(f"unknown task {req.task!r}")  # another tenant's private pipeline: as if none
            req.inputs = check_inputs(meta.signature.inputs, req.inputs)
            req.hops = [self.site]
            resp = await run_pipeline(meta, req, self.infer, lambda task, rows: stage_latency_ms(
                self.view.variants.get(task), rows, meta.floor(task)))
        except Exception as exc:
            self._door_failed(req, exc, None)
            self.metrics.pipeline(req.task, exc)
            raise
        self._door_late(req, resp, budget_end)
        self.metrics.door_ok(req.task, req.tenant, req.slo, resp)
        self.metrics.pipeline(req.task, resp)
        if resp.trace is not None:
            self.traces.add(req.request_id, trace_id_of(req.traceparent or ""), req.tenant, req.task, "ok",
                            resp.trace)
        return resp

    def rtt_correction(self, now: float | None = None) -> dict[str, float]:
        return self.paths.correction(time.monotonic() if now is None else now)

    async def _serve_local(self, req: InferRequest, variant_id: str, reason: str, best_effort: bool,
                           received: float, hop: HopTrace | None = None, *,
                           sender: str | None = None) -> InferResponse:
        """Run ``req`` here on ``variant_id``. ``hop``: a traced query's record at a hop that serves what an
        earlier hop decided (a hop that decided itself has recorded its decision already). ``sender``: the
        authenticated door that forwarded it, charged for a cold load it causes here."""
        if hop is not None:
            hop.serving(variant_id, reason)
        meta = self.view.variant(req.task, variant_id)
        if meta is None:
            raise NoRoute(f"{self.site}: variant {variant_id} of {req.task} not in catalog")
        if meta.owner not in (DEFAULT_TENANT, req.tenant):
            raise UnknownTask(f"task {req.task!r} has no variant {variant_id!r} for tenant {req.tenant!r}")
        try:
            # a strict tenant gets instances of its own: own session, batcher and backbone
            isolated_for = req.tenant if self._strict(req.tenant) else ""
            lv = self.host.instances.get((meta.variant_id, isolated_for))
            if lv is None:
                if sender is not None:  # raises Overloaded: the door has caused its share of loads here
                    self.peer_loads.charge(sender, (meta.variant_id, isolated_for))
                try:
                    lv = await self.host.ensure_by(meta, req.deadline, isolated_for)
                except PermissionDenied as exc:  # the store's refusal to this site (not placed its tenant yet)
                    raise BlobError(f"{self.site} may not fetch {meta.variant_id}: {exc.message}") from exc
            lv.touch(time.monotonic())
            result = await lv.batcher.submit(req.inputs, req.deadline, lane=variant_id, tenant=req.tenant)
        except MeshError as exc:
            self.metrics.served_failed(variant_id, exc.code)
            raise
        self.served += 1
        total = (time.monotonic() - received) * 1000.0
        self.metrics.served_ok(req.task, req.tenant, variant_id, "forwarded" if reason == "forwarded" else "local",
                               result.queue_ms, result.compute_ms, total, req.rows,
                               version=meta.version if meta.owner != DEFAULT_TENANT else 0)
        return InferResponse(
            request_id=req.request_id, outputs=result.outputs, site=self.site, variant=variant_id,
            accuracy=meta.accuracy, reason=reason, best_effort=best_effort, tenant=req.tenant,
            timing=Timing(network_ms=0.0, queue_ms=result.queue_ms, compute_ms=result.compute_ms,
                          total_ms=total),
            hops=req.hops, backbone_tenants=result.tenants if result.shared_backbone else 0)

    async def _forward(self, req: InferRequest, d: Decision, received: float, remaining_ms: float) -> InferResponse:
        endpoint = self._peer_endpoint(d.site)
        if endpoint is None:
            raise PeerUnavailable(f"{d.site} has no live endpoint")
        # this attempt's own limit: the peer gets that budget, and gives up when we do (counted from the send
        # that reaches it: one re-sent over a new connection, its peer re-keyed, gets it again; mesh.zmq.client)
        limit = attempt_ms(remaining_ms, d.expected_latency_ms, best_effort=d.best_effort)
        # the plan without the path's learnt correction (edge_agent.paths: what a sample is measured against)
        planned = d.expected_latency_ms - self.table_correction.get(d.site, 0.0)
        sent = time.monotonic()
        capped = sent + limit / 1000.0 < req.deadline
        fwd = InferRequest(task=req.task, inputs=req.inputs, slo=req.slo, tenant=req.tenant,
                           request_id=req.request_id, deadline=req.deadline,
                           hops=req.hops, target_site=d.site, target_variant=d.variant_id,
                           traceparent=None if req.traceparent is None else child_traceparent(req.traceparent))
        self.forwarded += 1
        self.metrics.forwarded(d.site)
        # this loop's own delay in getting to the answer: not the path's (edge_agent.paths)
        wait = ReplyWait()
        try:
            # keep back half the round trip measured to that peer: the forward transit, which the
            # peer cannot see (its deadline is its arrival plus the budget sent; mesh.zmq.protocol)
            resp = await self.zmq.request(endpoint, fwd, reserve_ms=self.net_rtt_ms.get(d.site, 0.0) / 2,
                                          attempt_ms=limit if capped else None, wait=wait)
        except (PeerUnavailable, DeadlineExceeded) as exc:
            now = time.monotonic()
            self.paths.observe_failure(d.site, (now - sent) * 1000.0, planned, limit, now,
                                       local_ms=wait.lag_s * 1000.0)
            if isinstance(exc, DeadlineExceeded) and capped and now < req.deadline:
                raise AttemptTimedOut(f"{d.site}: no reply within {limit:.0f} ms (expected "
                                      f"{d.expected_latency_ms:.0f} ms)") from exc
            # named by its site, as the caller knows it: the endpoint may be an address of this host's plumbing
            # (a lab's delay proxy) that no printed address mentions
            details = {k: v for k, v in exc.details.items() if k not in ("url", "site")}
            raise type(exc)(exc.message.replace(endpoint, f"site {d.site}"), site=d.site, **details) from exc
        now = time.monotonic()
        total = (now - received) * 1000.0
        remote = resp.timing
        network = max(0.0, total - remote.total_ms)
        local = wait.lag_s * 1000.0
        rtt = max(0.0, (now - sent) * 1000.0 - remote.total_ms - local)
        prev = self.net_rtt_ms.get(d.site)
        self.net_rtt_ms[d.site] = rtt if prev is None else 0.875 * prev + 0.125 * rtt
        # from this attempt's send, not the query's arrival: a retry's earlier attempt is not this path's
        self.paths.observe(d.site, (now - sent) * 1000.0 - planned, now, local_ms=local)
        resp.timing = Timing(network_ms=network, queue_ms=remote.queue_ms,
                             compute_ms=remote.compute_ms, total_ms=total)
        resp.reason, resp.best_effort = d.reason, d.best_effort
        return resp
