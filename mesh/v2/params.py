"""The mapping between Open Inference Protocol (KServe V2) vocabulary and tiermesh's: the SLO in request
``parameters``, the mesh metadata in response ``parameters``, and model metadata for a task's signature. Values
are checked by the types they become (``SLO``), and inputs by the data plane's door (``mesh.types.check_inputs``),
not here.

Pure functions, no I/O, no numpy (the SDK's base install reads replies with them); the datatypes are
:mod:`mesh.v2.datatypes`, the request and response bodies themselves are (de)serialised by
:mod:`mesh.v2.codec`; callers import the names here from this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mesh.errors import RequestError
from mesh.types import DEFAULT_PREFER, SLO, InferResponse, StageInfo, TaskSignature, TensorSpec, Timing
from mesh.v2.datatypes import V2_TO_NAME, check_datatype, datatype_named

__all__ = [
    "DEFAULT_LATENCY_MS",
    "backbone_tenants",
    "cascade_stages",
    "metadata_to_signature",
    "parse_slo",
    "parse_version",
    "response_parameters",
    "result_fields",
    "result_values",
    "signature_to_metadata",
]

DEFAULT_LATENCY_MS = 1000.0


# ---------------------------------------------------------------------------- requests


def parse_slo(params: Mapping[str, Any]) -> SLO:
    """The SLO carried in request ``parameters`` (absent ones take their defaults), checked by
    ``SLO.parse``; ``RequestError`` for values out of range."""
    get = params.get
    return SLO.parse(get("latency_ms", DEFAULT_LATENCY_MS), get("min_accuracy", 0.0), get("max_cost"),
                     get("prefer", DEFAULT_PREFER))


MAX_VERSION = 1_000_000


def parse_version(params: Mapping[str, Any]) -> int | None:
    """The version of the caller's task pinned in request ``parameters`` (``version``: a whole number from 1), or
    None; ``RequestError`` for anything else (a boolean, a fraction, text that is not a number)."""
    v = params.get("version")
    if v is None:
        return None
    if isinstance(v, str) and v.isascii() and v.isdecimal() and len(v) <= 7:
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_VERSION:
        raise RequestError(f"parameter version must be a whole number in [1, {MAX_VERSION}], got {str(v)[:40]!r}")
    return v


# ---------------------------------------------------------------------------- responses


def response_parameters(resp: InferResponse) -> dict[str, Any]:
    """Mesh metadata for a response's ``parameters`` (V2 allows only scalar values: hops is joined).
    ``late``: answered past the SLO's ``latency_ms``, counted from the query's entry (``timing_ms_total`` is that
    whole time); a late answer is an answer, never a met SLO (tritonclient users read it here)."""
    t = resp.timing
    out = {
        "site": resp.site, "variant": resp.variant, "accuracy": resp.accuracy, "reason": resp.reason,
        "best_effort": resp.best_effort, "tenant": resp.tenant,
        "timing_ms_network": t.network_ms, "timing_ms_queue": t.queue_ms,
        "timing_ms_compute": t.compute_ms, "timing_ms_total": t.total_ms,
        "hops": ",".join(resp.hops), "late": resp.late,
    }
    if resp.backbone_tenants:
        # run through a backbone shared across tenants; how many tenants its batch held
        out["shared_backbone"] = True
        out["backbone_batch_tenants"] = resp.backbone_tenants
    if resp.stages:
        # answered by a cascade: its id, stage 1's least confidence (a one-row query's confidence), and every stage
        # as JSON (V2 parameters are scalars; cascade_stages() reads it back)
        out["cascade"] = resp.cascade
        out["cascade_confidence"] = min(resp.stages[0].confidence, default=0.0)
        out["cascade_stages"] = json.dumps([
            {"stage": st.stage, "site": st.site, "variant": st.variant, "rows": st.rows, "answered": st.answered,
             "confidence": [round(c, 6) for c in st.confidence], "total_ms": round(st.total_ms, 3),
             "compute_ms": round(st.compute_ms, 3), **({"task": st.task} if st.task else {})}
            for st in resp.stages], separators=(",", ":"))
    return out


_MAX_STAGES_TEXT = 1 << 20  # a reply's stage list is a few hundred bytes a stage and a number per row


def cascade_stages(params: Mapping[str, Any]) -> tuple[StageInfo, ...]:
    """The stages of a reply answered by a cascade (``cascade_stages`` in its parameters); ``()`` when it has none
    or they are malformed (a reply is the edge's word, but a bad one must not fail a query it answered)."""
    text = params.get("cascade_stages")
    if type(text) is not str or len(text) > _MAX_STAGES_TEXT:
        return ()
    try:
        items = json.loads(text)
        return tuple(StageInfo(int(d["stage"]), str(d["site"]), str(d["variant"]), int(d["rows"]),
                               int(d["answered"]), tuple(float(c) for c in d["confidence"]), float(d["total_ms"]),
                               float(d["compute_ms"]), str(d.get("task", ""))) for d in items)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
        return ()


def _num(v: object) -> float:
    # a tuple, not int | float: isinstance with a union type is several times slower
    if type(v) is float:
        return v
    return float(v) if isinstance(v, (int, float)) else 0.0


def _text(v: object) -> str:
    return v if type(v) is str else str(v)


_RESULT_FIELDS = ("site", "variant", "accuracy", "reason", "best_effort", "tenant", "timing", "hops")
ResultValues = tuple[str, str, float, str, bool, str, Timing, list[str]]


def result_values(params: Mapping[str, Any]) -> ResultValues:
    """``result_fields`` as a tuple in that order (site, variant, accuracy, reason, best_effort,
    tenant, timing, hops): what the SDK builds its result from, with no dict in between."""
    # _text and _num written out for the types a reply carries (str, float): ten calls per reply otherwise
    get = params.get
    site, variant, reason, tenant = get("site", ""), get("variant", ""), get("reason", ""), get("tenant", "")
    acc, network, queue = get("accuracy", 0.0), get("timing_ms_network", 0.0), get("timing_ms_queue", 0.0)
    compute, total, hops = get("timing_ms_compute", 0.0), get("timing_ms_total", 0.0), get("hops")
    return (site if type(site) is str else str(site), variant if type(variant) is str else str(variant),
            acc if type(acc) is float else _num(acc), reason if type(reason) is str else str(reason),
            get("best_effort") is True, tenant if type(tenant) is str else str(tenant),
            Timing(network if type(network) is float else _num(network),
                   queue if type(queue) is float else _num(queue),
                   compute if type(compute) is float else _num(compute),
                   total if type(total) is float else _num(total)),
            [h for h in _text(hops).split(",") if h] if hops else [])


def backbone_tenants(params: Mapping[str, Any]) -> int:
    """``backbone_batch_tenants`` of a response's parameters (0 when absent or not a count)."""
    n = params.get("backbone_batch_tenants", 0)
    return n if type(n) is int and n >= 0 else 0


def result_fields(params: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of ``response_parameters``: keyword arguments describing where and how it was served."""
    return dict(zip(_RESULT_FIELDS, result_values(params), strict=True))


# ---------------------------------------------------------------------------- metadata


def _spec_json(s: TensorSpec) -> dict[str, Any]:
    return {"name": s.name, "datatype": datatype_named(s.dtype), "shape": list(s.shape)}


def signature_to_metadata(sig: TaskSignature) -> dict[str, Any]:
    """V2 model metadata for a task: the task stands in for the model; variants stay hidden."""
    return {"name": sig.task, "versions": [], "platform": "tiermesh",
            "inputs": [_spec_json(s) for s in sig.inputs],
            "outputs": [_spec_json(s) for s in sig.outputs],
            "parameters": {"metric": sig.metric}}


def metadata_to_signature(meta: Mapping[str, Any]) -> TaskSignature:
    def specs(key: str) -> tuple[TensorSpec, ...]:
        out = []
        for t in meta.get(key) or []:
            out.append(TensorSpec(str(t["name"]), V2_TO_NAME[check_datatype(t["datatype"])],
                                  tuple(int(d) for d in t["shape"])))
        return tuple(out)

    try:
        metric = (meta.get("parameters") or {}).get("metric", "top1")
        return TaskSignature(str(meta["name"]), specs("inputs"), specs("outputs"), str(metric))
    except (KeyError, TypeError, ValueError) as exc:
        raise RequestError(f"malformed model metadata: {exc}") from exc
