"""Serving a pipeline (issue 33, item 2; :mod:`variant_store.pipeline_meta`): a task declared as a graph of other
tasks, run at the door it entered by.

Each stage is sent as an *ordinary query of its own task* (``StageDoor``: the data plane's door, so the stage is
admitted, routed, placed, counted and traced as any query of that task: the edge may run stage 1 and the core
stage 2). Its inputs are fed by name from the pipeline's inputs and the previous stage's (or the selector's)
outputs; its budget is its share of what is left of the pipeline's, shares in proportion to the stages' profiled
latencies (:func:`split_budget`, re-split after each stage so time a stage did not use goes to the later ones); it
asks for the accuracy floor the pipeline was measured at (``PipelineMeta.floor``).

A Switch runs its selector on every row, then each row's branch (argmax of the selector's ``select`` output,
through the table), each branch once with its rows, the branches concurrently; the answer merges rows in order.

The reply (``reason`` ``pipeline``; ``cascade`` holds the pipeline's task) carries every stage that ran
(``InferResponse.stages``: its site, variant, rows and timing, rendered in the reply's parameters as a cascade's
are) and the pipeline's measured accuracy. Its SLO's ``min_accuracy`` is judged on that figure: a pipeline not
measured, or measured below it, is refused (``ImpossibleSLO``) when the caller asked ``prefer=refuse``, else served
as best effort. A stage that fails fails the query, its error (same type: same status) naming the stage, its task
and why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import numpy as np

from edge_agent.cascade_exec import merge_rows, take_rows
from mesh.errors import DeadlineExceeded, ImpossibleSLO, MeshError
from mesh.tracecontext import child_traceparent
from mesh.types import SLO, InferRequest, InferResponse, StageInfo, Timing
from variant_store.meta import VariantMeta
from variant_store.pipeline_meta import PipelineMeta, feed, switch_rows

__all__ = ["REASON", "StageDoor", "run_pipeline", "split_budget", "stage_latency_ms"]

REASON = "pipeline"
MIN_STAGE_MS = 1.0  # the least budget a stage is sent with (a stage query needs a positive one)

# sends one stage as an ordinary query of its task (the data plane's door) and returns its answer
StageDoor = Callable[[InferRequest], Awaitable[InferResponse]]


def stage_latency_ms(variants: Mapping[str, VariantMeta] | None, rows: int, floor: float = 0.0) -> float | None:
    """What a stage of a task is expected to cost: its fastest variant's profiled median latency at ``rows`` (any
    hardware class), among the variants at least ``floor`` accurate; None when none has a profile."""
    best: float | None = None
    for m in (variants or {}).values():
        if m.accuracy < floor:
            continue
        for p in m.profiles.values():
            ms = p.compute_ms(max(1, rows))
            if math.isfinite(ms) and (best is None or ms < best):
                best = ms
    return best


def split_budget(total_ms: float, stage_ms: Sequence[float | None]) -> list[float]:
    """``total_ms`` split across stages in proportion to their expected latencies ``stage_ms``; a stage of unknown
    (None) or non-positive cost counts as the mean of the known ones (all unknown: equal shares). The shares sum
    to ``total_ms`` (none when it is not positive: all zero)."""
    if not stage_ms:
        return []
    if not total_ms > 0:
        return [0.0] * len(stage_ms)
    known = [float(x) for x in stage_ms if x is not None and x > 0 and math.isfinite(x)]
    fill = sum(known) / len(known) if known else 1.0
    weights = [float(x) if x is not None and x > 0 and math.isfinite(x) else fill for x in stage_ms]
    whole = sum(weights)
    return [total_ms * w / whole for w in weights]


@dataclasses.dataclass(slots=True)
class _Run:
    """One pipeline query as it runs: what is left of its budget and each stage that ran."""

    req: InferRequest
    meta: PipelineMeta
    door: StageDoor
    costs: Callable[[str, int], float | None]   # a stage task's expected latency at a row count
    best_effort: bool
    stages: list[StageInfo] = dataclasses.field(default_factory=list)
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    last: InferResponse | None = None
    trace: list[dict[str, object]] = dataclasses.field(default_factory=list)  # a traced query's stages' records

    async def stage(self, k: int, task: str, inputs: dict[str, np.ndarray], share_ms: float,
                    branch: int | None = None) -> InferResponse:
        """Stage ``k`` (from 1) of ``task`` as an ordinary query with ``share_ms`` of the budget; ``branch``: a
        Switch's branch number (concurrent branch queries get request ids of their own)."""
        req = self.req
        rows = max((int(a.shape[0]) for a in inputs.values() if a.ndim), default=1)
        now = time.monotonic()
        end = min(req.deadline, now + share_ms / 1000.0)
        if end - now < MIN_STAGE_MS / 1000.0:
            raise _named(DeadlineExceeded(f"{max(0.0, (end - now) * 1000.0):.1f} ms left of the budget"),
                         self.meta, k, task)
        slo = SLO(latency_ms=(end - now) * 1000.0, min_accuracy=self.meta.floor(task), max_cost=req.slo.max_cost,
                  prefer=req.slo.prefer)
        rid = f"{req.request_id[:100]}.s{k}" + ("" if branch is None else f"b{branch}")
        sub = InferRequest(task=task, inputs=inputs, slo=slo, tenant=req.tenant, request_id=rid, deadline=end,
                           traceparent=None if req.traceparent is None else child_traceparent(req.traceparent))
        try:
            resp = await self.door(sub)
        except MeshError as exc:
            raise _named(exc, self.meta, k, task) from exc
        took = (time.monotonic() - now) * 1000.0
        self.queue_ms += resp.timing.queue_ms
        self.compute_ms += resp.timing.compute_ms
        self.best_effort = self.best_effort or resp.best_effort
        self.stages.append(StageInfo(k, resp.site, resp.variant, rows, rows, (), took, resp.timing.compute_ms, task))
        self.last = resp
        if resp.trace:
            self.trace.extend({**r, "pipeline_stage": k, "stage_task": task} for r in resp.trace)
        return resp

    def shares(self, tasks: Sequence[str], rows: int) -> list[float]:
        return split_budget(self.req.remaining_ms(), [self.costs(t, rows) for t in tasks])


def _named(exc: MeshError, meta: PipelineMeta, k: int, task: str) -> MeshError:
    """``exc`` again, its message naming the pipeline's stage and task (same type: same status)."""
    msg = f"pipeline {meta.task} stage {k} ({task}) failed: {exc.message}"
    details = {key: v for key, v in exc.details.items() if key not in ("stage", "stage_task")}
    try:
        return type(exc)(msg, stage=k, stage_task=task, **details)
    except TypeError:  # an error type whose constructor wants more than (message, **details)
        return MeshError(msg, stage=k, stage_task=task, code=exc.code)


def _judge_accuracy(meta: PipelineMeta, slo: SLO) -> bool:
    """Whether the pipeline's measured accuracy meets the SLO's floor; ``ImpossibleSLO`` when not and the caller
    asked to be refused (False: serve it as best effort)."""
    if slo.min_accuracy <= 0.0 or (meta.accuracy is not None and meta.accuracy >= slo.min_accuracy):
        return True
    if slo.prefer == "refuse":
        measured = "was never measured" if meta.accuracy is None else f"measured {meta.accuracy:.4f}"
        raise ImpossibleSLO(f"pipeline {meta.task} {measured} end to end; the SLO asks {slo.min_accuracy}",
                            reason="accuracy")
    return False


async def run_pipeline(meta: PipelineMeta, req: InferRequest, door: StageDoor,
                       costs: Callable[[str, int], float | None]) -> InferResponse:
    """Serve ``req`` (its inputs already checked against the pipeline's signature) by ``meta``: see the module
    docstring. ``door`` sends a stage query; ``costs`` gives a stage task's expected latency at a row count."""
    started = time.monotonic()
    run = _Run(req, meta, door, costs, best_effort=not _judge_accuracy(meta, req.slo))
    n = max((int(a.shape[0]) for a in req.inputs.values() if a.ndim), default=1)
    if meta.kind == "sequence":
        prev: dict[str, np.ndarray] = {}
        for k, st in enumerate(meta.stages, 1):
            share = run.shares([s.task for s in meta.stages[k - 1:]], n)[0]
            prev = (await run.stage(k, st.task, feed(st, req.inputs, prev), share)).outputs
        outputs = prev
    else:
        outputs = await _switch(run, n)
    assert run.last is not None
    total = (time.monotonic() - started) * 1000.0
    return InferResponse(
        request_id=req.request_id, outputs=outputs, site=run.last.site, variant=run.last.variant,
        accuracy=meta.accuracy if meta.accuracy is not None else 0.0, reason=REASON, best_effort=run.best_effort,
        tenant=req.tenant,
        timing=Timing(network_ms=max(0.0, total - run.queue_ms - run.compute_ms), queue_ms=run.queue_ms,
                      compute_ms=run.compute_ms, total_ms=total),
        hops=list(req.hops), backbone_tenants=run.last.backbone_tenants, cascade=meta.task, stages=tuple(run.stages),
        trace=run.trace if req.traceparent is not None else None)


async def _switch(run: _Run, n: int) -> dict[str, np.ndarray]:
    meta, req = run.meta, run.req
    selector = meta.stages[0]
    branch_ms = [run.costs(b.task, n) for b in meta.branches]
    worst = max((x for x in branch_ms if x is not None), default=None)
    share = run.shares([selector.task], n)[0] if worst is None else \
        split_budget(req.remaining_ms(), [run.costs(selector.task, n), worst])[0]
    sel = (await run.stage(1, selector.task, feed(selector, req.inputs, {}), share)).outputs
    try:
        by_task = switch_rows(meta, sel.get(meta.select), n)
    except MeshError as exc:
        raise _named(exc, meta, 1, selector.task) from exc
    left = req.remaining_ms()

    async def branch(i: int, task: str, rows: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        st = meta.branch(task)
        whole = len(rows) == n
        fed = feed(st, req.inputs if whole else take_rows(req.inputs, rows), sel if whole else take_rows(sel, rows))
        resp = await run.stage(2, task, fed, left, branch=i)
        return rows, resp.outputs

    runs = [asyncio.ensure_future(branch(i, t, np.asarray(r))) for i, (t, r) in enumerate(by_task.items())]
    try:
        parts = await asyncio.gather(*runs)
    except BaseException:  # one branch failed (or we were cancelled): the others stop with it
        for r in runs:
            r.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        raise
    try:
        return merge_rows(list(parts), n)
    except MeshError as exc:
        raise _named(exc, meta, 2, ",".join(by_task)) from exc
