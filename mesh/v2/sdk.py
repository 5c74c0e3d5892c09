"""The SDK's tensors: numpy arrays where numpy is installed, :class:`mesh.v2.plain.Tensor` where it is not.

``pip install tiermesh`` (the base install, for a device that only calls the mesh) brings no numpy; the
``numpy`` extra, and every server role, do. Which one this process has is decided once, at import, by whether
numpy can be found; a broken numpy install still fails loudly on import. Both sides offer the same calls, so
``mesh.client`` is written once:

    is_single(x)      x feeds a task's single input (not a dict of inputs by name)
    ready(named)      every input is already a tensor of this side (no task signature needed to convert it)
    prepare(named, sig)   the tensors to send, and the key of their names, datatypes and shapes (empty when a
                      BYTES tensor makes the header's size depend on contents: no kept header)
    tensor_data, encode_infer_request, decode_infer_response   the codec of this side

and the HTTP side of a request, alike on both:

    encode_plan(...)  a request encoded in full, and its ``Plan`` (JSON header, HTTP headers, path) for the next
                      of the same shape; ``with_id`` puts a request id into a plan's header (a plan has none)
    call_headers(h)   a caller's per-call HTTP headers, refused where they would replace the SDK's own
    decode_reply      an infer reply, decoded (``header``, ``retry_after``: its headers read)

With numpy, ndarrays go out and come back exactly as before this module existed; lists, ``array.array`` and
``Tensor`` inputs are converted to the task's dtypes. Without it, a caller passes nested lists, ``array.array``,
``str``/``bytes`` lists for BYTES inputs, or ``Tensor`` objects, and gets ``Tensor`` outputs.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from mesh.errors import BadTensor, RequestError
from mesh.types import TaskSignature
from mesh.v2.body import HEADER_LENGTH, TENANT_HEADER
from mesh.v2.datatypes import BYTES, BYTES_NAME, NAME_TO_V2
from mesh.v2.plain import Tensor, as_tensor, fit_shape

NUMPY = importlib.util.find_spec("numpy") is not None

if TYPE_CHECKING or NUMPY:
    import numpy as np

    from mesh.bytes_tensor import as_bytes_tensor
    from mesh.v2.codec import decode_infer_response, encode_infer_request
    from mesh.v2.tensors import tensor_data
else:  # used through this module by mesh.client (wire.encode_infer_request, ...)
    from mesh.v2.plain import decode_infer_response, encode_infer_request, tensor_data  # noqa: F401

# and this side's codec, chosen above: tensor_data, encode_infer_request, decode_infer_response
__all__ = ["NUMPY", "OWN_HEADERS", "Plan", "call_headers", "decode_reply", "encode_plan", "header", "is_single",
           "prepare", "ready", "retry_after", "with_id"]

ShapeKey = tuple[Any, ...]


def _specs(sig: TaskSignature | None) -> dict[str, Any]:
    return {s.name: s for s in sig.inputs} if sig is not None else {}


def _numpy_input(name: str, value: Any, spec: Any) -> np.ndarray:
    if type(value) is np.ndarray or isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, Tensor):
        arr = np.asarray(value)
    elif spec is not None and spec.dtype == BYTES_NAME:
        return as_bytes_tensor(value)
    else:
        try:
            arr = np.asarray(value, dtype=spec.dtype if spec is not None else None)
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadTensor(f"input {name!r}: values are not {spec.dtype if spec else 'a tensor'}: {exc}") from exc
        if spec is not None:
            arr = arr.reshape(fit_shape(arr.shape, spec.shape))
    # numpy str_/bytes_/object arrays (np.array(["a", "b"])) are the BYTES tensor a text task takes
    return as_bytes_tensor(arr) if arr.dtype.kind in "USO" else arr


def _plain_input(name: str, value: Any, spec: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if spec is None:
        raise BadTensor(f"input {name!r}: the task has no input of that name")
    return as_tensor(value, NAME_TO_V2.get(spec.dtype, spec.dtype), spec.shape, f"input {name!r}")


def _numpy_key(tensors: dict[str, Any]) -> ShapeKey:
    key = []
    for k, t in tensors.items():
        dt = t.dtype
        if dt.hasobject:
            return ()
        key.append((k, dt, t.shape))
    return tuple(key)


def _plain_key(tensors: dict[str, Any]) -> ShapeKey:
    if any(t.datatype == BYTES for t in tensors.values()):
        return ()
    return tuple((k, t.datatype, t.shape) for k, t in tensors.items())


_ARRAY: type = np.ndarray if NUMPY else Tensor
_input, _key = (_numpy_input, _numpy_key) if NUMPY else (_plain_input, _plain_key)


def prepare(named: Mapping[str, Any], sig: TaskSignature | None) -> tuple[dict[str, Any], ShapeKey]:
    if NUMPY and len(named) == 1:
        # the common case, one array of numbers: no signature needed, nothing to convert
        (name, value), = named.items()
        if type(value) is np.ndarray and value.dtype.kind not in "USOV":
            return {name: value}, ((name, value.dtype, value.shape),)
    specs = _specs(sig)
    tensors = {k: _input(k, v, specs.get(k)) for k, v in named.items()}
    return tensors, _key(tensors)


def is_single(inputs: object) -> bool:
    # the common case first, by exact type: isinstance against Mapping (an ABC) costs a micro-second
    return type(inputs) is _ARRAY or not (type(inputs) is dict or isinstance(inputs, Mapping))


def ready(named: Mapping[str, Any]) -> bool:
    return all(isinstance(v, _ARRAY) for v in named.values())


@dataclass(slots=True, frozen=True)
class Plan:
    header: bytes  # the request's JSON header (binary mode, no request id; empty in JSON mode)
    headers: dict[str, str]  # HTTP headers; transports only read them
    path: str


def encode_plan(task: str, tensors: dict[str, Any], params: dict[str, Any], request_id: str | None, binary: bool,
                base: Mapping[str, str]) -> tuple[Plan, bytes]:
    """An infer request encoded in full (its body), and its plan; ``base``: the client's own HTTP headers."""
    body, hlen = encode_infer_request(tensors, params, request_id=request_id, binary=binary)
    headers = dict(base)
    if hlen is None:
        headers["Content-Type"] = "application/json"
    else:
        headers["Content-Type"] = "application/octet-stream"
        headers[HEADER_LENGTH] = str(hlen)
    return Plan(body[:hlen] if hlen is not None else b"", headers, f"v2/models/{quote(task, safe='')}/infer"), body


def with_id(header: bytes, rid: str) -> bytes:
    """A JSON header without an id (a plan's, or a whole JSON body) with ``"id"`` put first."""
    return b'{"id":' + json.dumps(rid).encode() + b"," + header[1:]


# what the SDK writes itself: a caller's value would change the tenant asked for or break the body's framing
OWN_HEADERS = frozenset(h.lower() for h in (TENANT_HEADER, HEADER_LENGTH, "Content-Type", "Content-Length",
                                            "Transfer-Encoding"))


def call_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """A call's own HTTP headers, refused (``RequestError``) where they would replace one the SDK writes."""
    out: dict[str, str] = {}
    for k, v in headers.items():
        if type(k) is not str or type(v) is not str:
            raise RequestError(f"headers= takes str names and values, got {k!r}: {v!r}")
        if k.lower() in OWN_HEADERS:
            raise RequestError(f"header {k!r} is the SDK's own (tenant, body framing): it cannot be set per call")
        out[k] = v
    return out


def header(headers: Mapping[str, str], name: str) -> str | None:
    """A reply's header ``name``, whatever its case."""
    # aiohttp's headers look up case-insensitively, and most dicts use the canonical spelling
    found = headers.get(name)
    if found is not None:
        return found
    lname = name.lower()
    for k, v in headers.items():
        if k.lower() == lname:
            return v
    return None


def decode_reply(headers: Mapping[str, str], body: bytes) -> Any:
    """An infer reply's ``DecodedResponse`` (its binary header's length from ``headers``)."""
    raw_len = headers.get(HEADER_LENGTH)  # aiohttp's headers: case-insensitive already
    if raw_len is None:
        raw_len = header(headers, HEADER_LENGTH)
    return decode_infer_response(body, int(raw_len) if raw_len is not None else None)


def retry_after(headers: Mapping[str, str] | None) -> int | None:
    """RFC 9110 ``Retry-After`` in whole seconds (the delay form; a date or garbage: None)."""
    raw = header(headers, "Retry-After") if headers is not None else None
    if raw is None or not raw.strip().isdigit():
        return None
    return int(raw.strip())
