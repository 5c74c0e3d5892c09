"""The mapping between Open Inference Protocol (KServe V2) vocabulary and tiermesh's: datatypes,
the SLO in request ``parameters``, the mesh metadata in response ``parameters``, and model
metadata for a task's signature. Values are checked by the types they become (``SLO``), and
inputs by the data plane's door (``mesh.types.check_inputs``), not here.

Pure functions, no I/O; the request and response bodies themselves are (de)serialised by
:mod:`mesh.v2.codec`; callers import the names here from this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mesh.bytes_tensor import BYTES_DTYPE
from mesh.errors import BadTensor, RequestError
from mesh.types import DEFAULT_PREFER, SLO, InferResponse, TaskSignature, TensorSpec, Timing

__all__ = [
    "DEFAULT_LATENCY_MS",
    "DTYPE_TO_V2",
    "NATIVE",
    "V2_TO_NP",
    "datatype_of",
    "dtype_of",
    "metadata_to_signature",
    "parse_slo",
    "response_parameters",
    "result_fields",
    "result_values",
    "signature_to_metadata",
]

DEFAULT_LATENCY_MS = 1000.0

# V2 datatype -> numpy dtype (explicitly little-endian: the binary extension is LE on the wire).
# Fixed-size types only: BYTES (variable-length elements, a numpy object array) is handled beside
# them (``mesh.bytes_tensor``); BF16 is served by no tiermesh task, so it is rejected rather than
# half-supported.
V2_TO_NP: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
_NAME_TO_V2: dict[str, str] = {dt.name: v2 for v2, dt in V2_TO_NP.items()}
# keyed by dtype: a dict lookup instead of the ``dtype.name`` property; big-endian dtypes miss
DTYPE_TO_V2: dict[np.dtype[Any], str] = {dt: v2 for v2, dt in V2_TO_NP.items()}
# the same types in this machine's byte order: what decoded tensors are converted to
NATIVE: dict[str, np.dtype[Any]] = {v2: dt.newbyteorder("=") for v2, dt in V2_TO_NP.items()}


def dtype_of(datatype: object) -> np.dtype[Any]:
    """numpy dtype of a V2 datatype string (``object`` for BYTES); ``BadTensor`` for anything else."""
    if datatype == "BYTES":
        return BYTES_DTYPE
    if not isinstance(datatype, str) or datatype not in V2_TO_NP:
        raise BadTensor(f"unsupported datatype {datatype!r}; expected one of {sorted([*V2_TO_NP, 'BYTES'])}")
    return V2_TO_NP[datatype]


def datatype_of(dtype: np.dtype[Any] | str) -> str:
    """V2 datatype string of a numpy dtype (or dtype name such as ``"float32"``)."""
    if isinstance(dtype, np.dtype) and (v2 := DTYPE_TO_V2.get(dtype)) is not None:
        return v2
    name = np.dtype(dtype).name
    if name == "object":
        return "BYTES"
    if name not in _NAME_TO_V2:
        raise BadTensor(f"dtype {name} has no V2 datatype tiermesh serves")
    return _NAME_TO_V2[name]


# ---------------------------------------------------------------------------- requests


def parse_slo(params: Mapping[str, Any]) -> SLO:
    """The SLO carried in request ``parameters`` (absent ones take their defaults), checked by
    ``SLO.parse``; ``RequestError`` for values out of range."""
    get = params.get
    return SLO.parse(get("latency_ms", DEFAULT_LATENCY_MS), get("min_accuracy", 0.0), get("max_cost"),
                     get("prefer", DEFAULT_PREFER))


# ---------------------------------------------------------------------------- responses


def response_parameters(resp: InferResponse) -> dict[str, Any]:
    """Mesh metadata for a response's ``parameters`` (V2 allows only scalar values: hops is joined)."""
    t = resp.timing
    return {
        "site": resp.site, "variant": resp.variant, "accuracy": resp.accuracy, "reason": resp.reason,
        "best_effort": resp.best_effort, "tenant": resp.tenant,
        "timing_ms_network": t.network_ms, "timing_ms_queue": t.queue_ms,
        "timing_ms_compute": t.compute_ms, "timing_ms_total": t.total_ms,
        "hops": ",".join(resp.hops),
    }


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
    get = params.get
    hops = get("hops")
    return (_text(get("site", "")), _text(get("variant", "")), _num(get("accuracy", 0.0)),
            _text(get("reason", "")), get("best_effort") is True, _text(get("tenant", "")),
            Timing(_num(get("timing_ms_network", 0.0)), _num(get("timing_ms_queue", 0.0)),
                   _num(get("timing_ms_compute", 0.0)), _num(get("timing_ms_total", 0.0))),
            [h for h in _text(hops).split(",") if h] if hops else [])


def result_fields(params: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of ``response_parameters``: keyword arguments describing where and how it was served."""
    return dict(zip(_RESULT_FIELDS, result_values(params), strict=True))


# ---------------------------------------------------------------------------- metadata


def _spec_json(s: TensorSpec) -> dict[str, Any]:
    return {"name": s.name, "datatype": datatype_of(s.dtype), "shape": list(s.shape)}


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
            out.append(TensorSpec(str(t["name"]), dtype_of(t["datatype"]).newbyteorder("=").name,
                                  tuple(int(d) for d in t["shape"])))
        return tuple(out)

    try:
        metric = (meta.get("parameters") or {}).get("metric", "top1")
        return TaskSignature(str(meta["name"]), specs("inputs"), specs("outputs"), str(metric))
    except (KeyError, TypeError, ValueError) as exc:
        raise RequestError(f"malformed model metadata: {exc}") from exc
