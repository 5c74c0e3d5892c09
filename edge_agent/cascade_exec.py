"""Running a cascade routing chose (issue 33; ``core_scheduler.policy.routing_cascade``): the door sends the query to
stage 1's (site, variant), as the data plane sends any query it decided (served here, or forwarded pinned to that
site and variant), reads each row's confidence from its output logits (``variant_store.cascade_meta.confidence``
under the cascade's rule), and sends the rows below the stage's threshold, together, as one query to the next
stage, with what is left of the query's budget (its deadline is the query's). The last stage answers every row it
gets. The answer merges each row's output in the rows' order.

The reply says which stage answered (reason ``cascade_local`` when stage 1 answered every row, else
``cascade_escalated``), the confidences, and each stage's site, variant, rows and timing (``InferResponse.stages``,
rendered in the reply's parameters by ``mesh.v2.params``). Its site and variant are those of the last stage that
ran; its accuracy the cascade's measured one.

A failing stage fails the query, its error (same type, so the same HTTP status) naming the stage, its variant and
site: a cascade is not retried stage by stage (the door's retry loop is for plain forwards), as a stage's failure
after stage 1 answered some rows would otherwise be answered by a different plan than the reply says.

The logits are the task signature's first output; a stage whose output is not (rows, classes >= 2) fails as such.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from core_scheduler.policy.routing import Decision
from core_scheduler.policy.routing_cascade import CascadePlan
from edge_agent.traces import HopTrace, clean_hops
from mesh.errors import MeshError
from mesh.types import InferRequest, InferResponse, StageInfo, Timing
from variant_store.cascade_meta import confidence

__all__ = ["ESCALATED", "LOCAL", "REASONS", "StageRun", "door_runner", "merge_rows", "run_cascade"]

LOCAL, ESCALATED = "cascade_local", "cascade_escalated"
REASONS = (LOCAL, ESCALATED)


@dataclass(frozen=True, slots=True)
class StageRun:
    """What the data plane is asked to run for one stage: its number (from 1), (site, variant), the expected
    latency routing gave it, and the inputs of the rows it gets."""

    stage: int
    site: str
    variant: str
    expected_ms: float
    inputs: dict[str, np.ndarray]


# runs one stage as a query pinned to its (site, variant) and returns that query's answer
StageRunner = Callable[[StageRun], Awaitable[InferResponse]]


def door_runner(here: str, req: InferRequest, hop: HopTrace | None, *,
                local: Callable[[InferRequest, str], Awaitable[InferResponse]],
                forward: Callable[[InferRequest, Decision], Awaitable[InferResponse]]) -> StageRunner:
    """How the door at ``here`` runs a stage of ``req``: a copy of it with the stage's rows, served ``local``-ly
    (variant) when the stage's site is ``here``, else forwarded pinned to the stage's (site, variant) as a routing
    decision is. A traced query gets a record per stage (choice reason ``cascade_stage_<k>``, the stage's timings,
    then the records of the site it was forwarded to)."""

    async def run(s: StageRun) -> InferResponse:
        sub = dataclasses.replace(req, inputs=s.inputs)
        if hop is not None:
            hop.serving(s.variant, f"cascade_stage_{s.stage}")
            hop.records[-1]["choice"]["site"] = s.site
        if s.site == here:
            out = await local(sub, s.variant)
        else:
            # a stage is never retried elsewhere (the plan pins it), so cutting its forward short at the
            # attempt limit would only fail a query that had budget left: it may take all of what is left, as a
            # best-effort forward may (edge_agent.paths.attempt_ms; the cascade's answer is not best effort)
            out = await forward(sub, Decision(s.site, s.variant, "forward", s.expected_ms, 0.0, 0.0, True, 1))
        if hop is not None:
            hop.timed(out.timing)
            hop.records.extend(clean_hops(out.trace))
        return out

    return run


def take_rows(inputs: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    """``inputs`` restricted to ``rows`` (indices, in order) along the leading axis."""
    return {name: np.ascontiguousarray(a[rows]) for name, a in inputs.items()}


def merge_rows(parts: list[tuple[np.ndarray, dict[str, np.ndarray]]], n: int) -> dict[str, np.ndarray]:
    """One output per name for ``n`` rows, from each stage's answer to the rows it answered: ``parts`` are
    (row indices into the query, that stage's outputs for exactly those rows, in that order). Every row must be
    answered once; a stage's output of another shape or dtype than the first's is a ``MeshError``."""
    first = parts[0][1]
    out = {name: np.empty((n, *a.shape[1:]), dtype=a.dtype) for name, a in first.items()}
    seen = np.zeros(n, dtype=bool)
    for rows, outputs in parts:
        if set(outputs) != set(out):
            raise MeshError(f"cascade stages answered different outputs: {sorted(outputs)} and {sorted(out)}")
        for name, a in outputs.items():
            if a.shape != (len(rows), *out[name].shape[1:]) or a.dtype != out[name].dtype:
                raise MeshError(f"cascade stage output {name!r} is {a.dtype}{list(a.shape)} for {len(rows)} rows, "
                                f"not {out[name].dtype}{[len(rows), *out[name].shape[1:]]}")
            out[name][rows] = a
        seen[rows] = True
    if not seen.all():
        raise MeshError(f"cascade left rows {np.flatnonzero(~seen).tolist()[:10]} unanswered")
    return out


def _named(exc: MeshError, plan: CascadePlan, stage: int) -> MeshError:
    """``exc`` again, its message naming the cascade's stage, variant and site (same type: same status)."""
    site, variant = plan.sites[stage - 1], plan.variants[stage - 1]
    msg = f"cascade {plan.cascade_id} stage {stage} ({variant} at {site}) failed: {exc.message}"
    details = {k: v for k, v in exc.details.items() if k not in ("stage", "stage_site", "stage_variant")}
    try:
        return type(exc)(msg, stage=stage, stage_site=site, stage_variant=variant, **details)
    except TypeError:  # an error type whose constructor wants more than (message, **details)
        return MeshError(msg, stage=stage, stage_site=site, stage_variant=variant, code=exc.code)


async def run_cascade(plan: CascadePlan, inputs: dict[str, np.ndarray], logits: str, run: StageRunner,
                      *, request_id: str, tenant: str, hop: HopTrace | None = None) -> InferResponse:
    """Serve ``inputs`` (already checked against the task's signature) by ``plan``; ``logits``: the output the
    confidence is read from; ``run``: the data plane's way to run one stage (:func:`door_runner`). ``hop``: a
    traced query's door record, which gets a last record for the answer (timed by the door). See the module
    docstring."""
    started = time.monotonic()
    n = max((int(a.shape[0]) for a in inputs.values() if a.ndim), default=1)
    pending = np.arange(n)
    parts: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []
    stages: list[StageInfo] = []
    last: InferResponse | None = None
    queue_ms = compute_ms = 0.0
    for k in range(1, len(plan.variants) + 1):
        final = k == len(plan.variants)
        sent = time.monotonic()
        sub = inputs if len(pending) == n else take_rows(inputs, pending)
        try:
            resp = await run(StageRun(k, plan.sites[k - 1], plan.variants[k - 1], plan.stage_ms[k - 1], sub))
        except MeshError as exc:
            raise _named(exc, plan, k) from exc
        took = (time.monotonic() - sent) * 1000.0
        queue_ms += resp.timing.queue_ms
        compute_ms += resp.timing.compute_ms
        last = resp
        if final:
            parts.append((pending, resp.outputs))
            stages.append(StageInfo(k, resp.site, resp.variant, len(pending), len(pending), (), took,
                                    resp.timing.compute_ms))
            break
        out = resp.outputs.get(logits)
        try:
            if out is None:
                raise ValueError(f"no output {logits!r}")
            conf = confidence(plan.rule, out)  # type: ignore[arg-type]  # CascadePlan.rule is a checked Rule
            if len(conf) != len(pending):
                raise ValueError(f"{len(conf)} rows of output for {len(pending)} rows asked")
        except ValueError as exc:
            raise _named(MeshError(f"its output cannot be read as logits: {exc}"), plan, k) from exc
        sure = conf >= plan.thresholds[k - 1]
        if sure.any():
            parts.append((pending[sure], {name: a[sure] for name, a in resp.outputs.items()}))
        stages.append(StageInfo(k, resp.site, resp.variant, len(pending), int(sure.sum()),
                                tuple(float(c) for c in conf), took, resp.timing.compute_ms))
        pending = pending[~sure]
        if not len(pending):
            break
    assert last is not None
    try:
        outputs = merge_rows(parts, n)
    except MeshError as exc:
        raise _named(exc, plan, len(stages)) from exc
    total = (time.monotonic() - started) * 1000.0
    if hop is not None:
        hop.serving(last.variant, LOCAL if len(stages) == 1 else ESCALATED)
        hop.records[-1]["choice"]["site"] = last.site
    return InferResponse(
        request_id=request_id, outputs=outputs, site=last.site, variant=last.variant, accuracy=plan.accuracy,
        reason=LOCAL if len(stages) == 1 else ESCALATED, best_effort=False, tenant=tenant,
        timing=Timing(network_ms=max(0.0, total - queue_ms - compute_ms), queue_ms=queue_ms, compute_ms=compute_ms,
                      total_ms=total),
        hops=last.hops, backbone_tenants=last.backbone_tenants, cascade=plan.cascade_id, stages=tuple(stages))
