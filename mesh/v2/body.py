"""The body layout of the Open Inference Protocol (KServe V2), without tensors: a JSON header, then the raw bytes
of every binary tensor; ``Inference-Header-Content-Length`` gives the header's length whenever binary data
follows it. The request's header shape (:func:`request_head`) and the HTTP header names live here too.

Needs no numpy: both tensor codecs stand on it, :mod:`mesh.v2.tensors` (numpy arrays: the server, and the SDK
where numpy is installed) and :mod:`mesh.v2.plain` (the SDK's base install), so they lay bodies out alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from mesh.errors import PayloadTooLarge, RequestError

__all__ = [
    "HEADER_LENGTH",
    "JSON_OPTS",
    "TENANT_HEADER",
    "DecodedResponse",
    "assemble",
    "dumps",
    "request_head",
    "response_meta",
    "split_body",
    "tenant_claim",
]

HEADER_LENGTH = "Inference-Header-Content-Length"
# Names the caller's tenant until mutual TLS does (see ``edge_agent.http_api.identify``).
TENANT_HEADER = "X-Tiermesh-Tenant"


def tenant_claim(values: list[str]) -> str | None:
    """The one tenant the ``TENANT_HEADER`` values of a request name (stripped; None: no header, or empty).
    ``RequestError`` when the header comes more than once or lists several names: which one counted depended on
    the reader (the first, for aiohttp's ``get``), so a proxy that appends the header let its caller choose."""
    if not values:
        return None
    if len(values) > 1 or "," in values[0]:
        raise RequestError(f"header {TENANT_HEADER} must name one tenant once, got {values!r}")
    return values[0].strip() or None

# orjson parses and writes a header in about a micro-second, bytes in and out (the stdlib needs
# five to ten, plus a str round trip). It reads a memoryview, so the header is never sliced out of
# the body. Its dialect is strict JSON: NaN/Infinity are refused on input and written as null.
_loads = orjson.loads
JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY  # numpy scalars (np.float64 accuracies), as the stdlib wrote them


def dumps(head: dict[str, Any]) -> bytes:
    return orjson.dumps(head, option=JSON_OPTS)


def split_body(body: bytes, header_length: int | None, max_bytes: int) -> tuple[dict[str, Any], memoryview]:
    if len(body) > max_bytes:
        raise PayloadTooLarge(f"body of {len(body)} bytes exceeds the limit of {max_bytes}")
    if header_length is None:
        header_length = len(body)
    if header_length < 0 or header_length > len(body):
        raise RequestError(f"{HEADER_LENGTH} is {header_length} but the body has {len(body)} bytes")
    view = memoryview(body)
    try:
        head = _loads(view[:header_length] if header_length != len(body) else body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"body is not valid JSON: {exc}") from exc
    if type(head) is not dict:
        raise RequestError("body must be a JSON object")
    return head, view[header_length:]


def assemble(head: dict[str, Any], blobs: list[bytes | memoryview | None]) -> tuple[bytes, int | None]:
    header = dumps(head)
    # a JSON tensor's blob is None: its data is in the header
    data = cast("list[bytes | memoryview]", blobs) if None not in blobs else [b for b in blobs if b is not None]
    if not data:
        return header, None
    return b"".join([header, *data]), len(header)


def request_head(tensors: list[dict[str, Any]], parameters: Mapping[str, Any], request_id: str | None,
                 binary: bool) -> dict[str, Any]:
    """The JSON header of an infer request asking for every output (binary if ``binary``)."""
    params = dict(parameters)
    if binary:
        params["binary_data_output"] = True
    return ({"id": request_id, "parameters": params, "inputs": tensors} if request_id
            else {"parameters": params, "inputs": tensors})


def response_meta(head: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A response header's request id and ``parameters`` (lenient: a reply is read, not judged)."""
    params = head.get("parameters") or {}
    rid = head.get("id", "")
    return rid if type(rid) is str else str(rid), params if isinstance(params, dict) else {}


@dataclass(slots=True)
class DecodedResponse:
    """An infer response as read by a client: ``outputs`` are numpy arrays (:mod:`mesh.v2.codec`) or
    :class:`mesh.v2.plain.Tensor` objects (:mod:`mesh.v2.plain`), by the codec that read it."""

    request_id: str
    outputs: dict[str, Any]
    parameters: dict[str, Any] = field(default_factory=dict)
