"""Open Inference Protocol (KServe V2) codec: JSON tensors and the binary tensor extension.

Pure functions, no I/O. The HTTP front (``edge_agent.http_api``) decodes requests and encodes
responses with them; the SDK (``mesh.client``) does the reverse with the same code, so both ends
agree byte for byte. The layout matches what ``tritonclient.http`` sends and parses: a JSON
header, then the raw little-endian bytes of every tensor whose ``parameters.binary_data_size``
is set, in the order the tensors appear; ``Inference-Header-Content-Length`` gives the JSON
header's length whenever binary data follows it (:mod:`mesh.v2.body`).

tiermesh fields ride in ``parameters``: the SLO on the request, the serving site, variant,
accuracy, decision reason and timing on the response. That mapping, the datatype table and model
metadata live in :mod:`mesh.v2.params`, the tensor encoding in :mod:`mesh.v2.tensors` (numpy arrays; the SDK's
base install uses :mod:`mesh.v2.plain`, without numpy), the body layout in :mod:`mesh.v2.body`; callers import
each name from its home.

Hot paths avoid what costs microseconds each on every request: ``dtype.name`` (a Python
property), the stdlib's JSON (orjson reads and writes headers as bytes), ``bytes`` detours for
tensor data (one copy into the body; out of it, one copy for the SDK's caller and none for the
server, which reads its inputs in place).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mesh.cache import BoundedCache
from mesh.errors import RequestError
from mesh.types import SLO
from mesh.v2.body import DecodedResponse, assemble, request_head, response_meta, split_body
from mesh.v2.classify import class_count
from mesh.v2.params import parse_slo
from mesh.v2.tensors import Spec, arrays_at, binary_specs, read_tensors, tensors_json

__all__ = [
    "DecodedRequest",
    "decode_infer_request",
    "decode_infer_response",
    "encode_infer_request",
    "encode_infer_response",
]

# ---------------------------------------------------------------------------- requests


@dataclass(slots=True)
class DecodedRequest:
    request_id: str | None
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    # output name -> send as binary; None means "all outputs" with ``binary_default``
    outputs: dict[str, bool] | None = None
    binary_default: bool = False
    # the SLO of ``parameters`` when a kept header brought it, already parsed (None: parse it with
    # ``mesh.v2.params.parse_slo``, which says what is wrong with it)
    slo: SLO | None = None
    # output name -> k of an output asked for as its top k classes (``mesh.v2.classify``); None: none asked
    classification: dict[str, int] | None = None


# A client sends the same header query after query (same tensors, same SLO, no id): its parsed
# form is kept, keyed by the header's bytes, so a repeat skips JSON and the checks. Only headers
# that passed every check are kept (their SLO too, parsed), copied out of the body; parameters go out
# as a fresh dict.
_PLAN_HEADER_MAX = 4096
_PLANS: BoundedCache[bytes, tuple[dict[str, Any], tuple[Spec, ...], bool, int, SLO]] = BoundedCache(256)


def decode_infer_request(body: bytes, header_length: int | None = None, *,
                         max_bytes: int = 16 << 20, copy: bool = True) -> DecodedRequest:
    """Parse a V2 infer request body (JSON, or JSON header + binary tensors). With ``copy=False``
    binary tensors in native byte order are read-only views of ``body`` (no copy; they keep it
    alive): what a server wants, since it only reads its inputs."""
    # the length of a header that may be kept, else 0
    keep = (header_length if type(body) is bytes and header_length is not None
            and 0 < header_length <= _PLAN_HEADER_MAX else 0)
    if keep:
        plan = _PLANS.get(body[:keep])
        if plan is not None and len(body) == plan[3] and len(body) <= max_bytes:
            return DecodedRequest(None, arrays_at(plan[1], body, keep, copy), dict(plan[0]), None, plan[2],
                                  plan[4])
    head, tail = split_body(body, header_length, max_bytes)
    rid, params = head.get("id"), head.get("parameters")
    if (rid is None or type(rid) is str) and type(params) is dict and head.get("outputs") is None:
        specs = binary_specs(head.get("inputs"), len(tail), max_bytes)
        if specs is not None:
            binary_default = params.get("binary_data_output") is True
            slo: SLO | None = None
            if keep and rid is None:
                with contextlib.suppress(RequestError):  # a bad SLO: not kept, the caller's parse_slo says why
                    slo = parse_slo(params)
                    _PLANS.put(body[:keep], (dict(params), specs, binary_default, len(body), slo))
            return DecodedRequest(rid, arrays_at(specs, tail, 0, copy), params, None, binary_default, slo)
    if rid is not None and not isinstance(rid, str):
        raise RequestError(f"'id' must be a string, got {type(rid).__name__}")
    params = params or {}
    if not isinstance(params, dict):
        raise RequestError("'parameters' must be an object")
    if "inputs" not in head:
        raise RequestError("request has no 'inputs'")
    inputs = read_tensors(head["inputs"], tail, "input", max_bytes, copy)
    outputs: dict[str, bool] | None = None
    classification: dict[str, int] | None = None
    binary_default = params.get("binary_data_output") is True
    if head.get("outputs") is not None:
        if not isinstance(head["outputs"], list):
            raise RequestError("'outputs' must be a list")
        outputs = {}
        for o in head["outputs"]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise RequestError("each requested output needs a string 'name'")
            oparams = o.get("parameters") or {}
            flag = oparams.get("binary_data") if isinstance(oparams, dict) else None
            outputs[o["name"]] = binary_default if flag is None else flag is True
            if isinstance(oparams, dict) and oparams.get("classification") is not None:
                classification = classification or {}
                classification[o["name"]] = class_count(oparams["classification"], o["name"])
    return DecodedRequest(rid, inputs, params, outputs, binary_default, None, classification)


def encode_infer_request(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any], *,
                         request_id: str | None = None, binary: bool = True) -> tuple[bytes, int | None]:
    """Body and header length of a V2 infer request asking for every output (binary if ``binary``)."""
    tensors, blobs = tensors_json(inputs, binary)
    return assemble(request_head(tensors, parameters, request_id, binary), blobs)


# ---------------------------------------------------------------------------- responses


def encode_infer_response(model_name: str, request_id: str, outputs: Mapping[str, np.ndarray],
                          parameters: Mapping[str, Any],
                          binary: bool | Mapping[str, bool]) -> tuple[bytes, int | None]:
    """Body and header length of a V2 infer response; ``binary`` picks the encoding for every
    output, or per output name (absent names go as JSON)."""
    tensors, blobs = tensors_json(outputs, binary)
    head = {"model_name": model_name, "model_version": "", "id": request_id,
            "parameters": parameters if type(parameters) is dict else dict(parameters), "outputs": tensors}
    return assemble(head, blobs)


# A client reads reply after reply describing the same outputs (names, datatypes, shapes, sizes). The parsed
# ``outputs`` of the last well-formed binary reply are kept with their specs; a reply whose parsed ``outputs``
# compare equal (one C-level comparison) and fill the same bytes reuses them instead of checking every field
# again (equal values read the same: a shape of [1.0, 10] would be read as [1, 10], as the reply it equals).
# One entry, replaced as a whole (so threads never see half of one): bounded by construction.
_LAST_OUTPUTS: tuple[object, int, tuple[Spec, ...]] = (None, -1, ())


def decode_infer_response(body: bytes, header_length: int | None = None, *,
                          max_bytes: int = 1 << 31, copy: bool = True) -> DecodedResponse:
    """Parse a V2 infer response; ``copy`` as for ``decode_infer_request`` (the SDK keeps the
    default, so callers own writable outputs)."""
    global _LAST_OUTPUTS
    head, tail = split_body(body, header_length, max_bytes)
    items, end = head.get("outputs"), len(tail)
    last = _LAST_OUTPUTS
    if last[1] == end and last[0] == items:  # the same outputs as the last reply: checked already
        specs: tuple[Spec, ...] | None = last[2]
    else:
        specs = binary_specs(items, end, max_bytes)
        if specs is not None:
            _LAST_OUTPUTS = (items, end, specs)
    outputs = (arrays_at(specs, tail, 0, copy) if specs is not None
               else read_tensors(head.get("outputs", []), tail, "output", max_bytes, copy))
    rid, params = response_meta(head)
    return DecodedResponse(rid, outputs, params)
