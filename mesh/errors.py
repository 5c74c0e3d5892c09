"""One error hierarchy for all of tiermesh.

    MeshError                       code            HTTP   meaning
    ├── ConfigError                 bad_config      400    settings / CLI arguments wrong
    ├── TopologyError               bad_topology    400    topology YAML invalid (carries file, line, field)
    ├── StoreError                  store           503    etcd unreachable or failed
    │   ├── StoreUnavailable        store_down      503    cannot reach etcd at all
    │   └── ConflictError           conflict        409    compare-and-swap lost (stale revision)
    ├── EtcdServerError             etcd_server     500    the embedded etcd process failed to start/stop
    ├── CatalogError                catalog         404    unknown model/variant in the catalog
    ├── BlobError                   blob            502    blob missing or digest mismatch
    ├── VariantBuildError           build           500    a variant generator could not produce its variant
    ├── RuntimeLoadError            runtime_load    500    a runtime could not load a variant
    ├── RequestError                bad_request     400    the caller's request is malformed
    │   ├── UnknownTask             unknown_task    404    no such task
    │   ├── UnknownTenant           unknown_tenant  403    tenant not in the topology
    │   ├── BadTensor               bad_tensor      400    wrong shape / dtype / size
    │   ├── PayloadTooLarge         too_large       413    body or tensor over the limit
    │   ├── ImpossibleSLO           impossible_slo  422    no variant anywhere can meet the SLO and prefer=refuse
    │   ├── ModelRejected           bad_model       422    an uploaded model failed a check (``reason`` says which)
    │   ├── CascadeRefused          bad_cascade     422    a cascade cannot be calibrated or registered (``reason``)
    │   └── PipelineRefused         bad_pipeline    422    a pipeline graph cannot be registered (``reason``)
    ├── DeadlineExceeded            deadline        504    the request's absolute deadline passed (also a
    │                                                      ``TimeoutError``: ``except TimeoutError`` catches it)
    ├── Overloaded                  overloaded      503    queue would hold the request past its deadline
    ├── QuotaExceeded               quota_exceeded  429    the tenant is over its quota at this door (``retry_after_s``)
    ├── NoRoute                     no_route        503    no live site can serve the task
    ├── PeerUnavailable             peer_down       502    a forwarded hop did not answer
    │   └── EdgeStalled             stalled         503    this edge's process was stopped (frozen) while the query
    │                                                      waited at its door, past its budget: not run; ask another
    ├── ProtocolError               protocol        400    a wire frame, or a value read from etcd, could not be decoded
    ├── PkiError                    pki             500    our own CA, keys or revocation list are missing or unusable
    ├── Unauthenticated             unauthenticated 401    a peer's credential proves no identity (``reason`` says why:
    │                                                      no certificate, wrong CA, expired, revoked, SAN, EKU, ...)
    └── PermissionDenied            forbidden       403    an authenticated identity may not do this (wrong kind, ...)

Every error has a stable ``code`` (used on the wire and in HTTP bodies) and ``http_status``.
Translate foreign exceptions at module boundaries with ``raise XError(...) from exc``.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

__all__ = [
    "BadTensor",
    "BlobError",
    "CascadeRefused",
    "CatalogError",
    "ConfigError",
    "ConflictError",
    "DeadlineExceeded",
    "EdgeStalled",
    "EtcdServerError",
    "ImpossibleSLO",
    "MeshError",
    "ModelRejected",
    "NoRoute",
    "Overloaded",
    "PayloadTooLarge",
    "PeerUnavailable",
    "PermissionDenied",
    "PkiError",
    "ProtocolError",
    "QuotaExceeded",
    "RequestError",
    "RuntimeLoadError",
    "StoreError",
    "StoreUnavailable",
    "TopologyError",
    "Unauthenticated",
    "UnknownTask",
    "UnknownTenant",
    "VariantBuildError",
    "error_from_code",
    "error_from_reply",
]


class MeshError(Exception):
    """Base of every tiermesh error."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "error": self.message}
        if self.details:
            out["details"] = {k: v for k, v in self.details.items() if _plain(v)}
        return out


def _plain(v: Any) -> bool:
    return isinstance(v, str | int | float | bool | type(None) | list | dict)


class ConfigError(MeshError):
    code = "bad_config"
    http_status = 400


class TopologyError(MeshError):
    """A topology file is invalid. ``file``, ``line`` and ``field`` say where."""

    code = "bad_topology"
    http_status = 400

    def __init__(self, message: str, *, file: str = "<string>", line: int | None = None,
                 field: str | None = None) -> None:
        where = file if line is None else f"{file}:{line}"
        text = f"{where}: {field}: {message}" if field else f"{where}: {message}"
        super().__init__(text, file=file, line=line, field=field)
        self.file, self.line, self.field, self.reason = file, line, field, message


class StoreError(MeshError):
    code = "store"
    http_status = 503


class StoreUnavailable(StoreError):
    code = "store_down"
    http_status = 503


class ConflictError(StoreError):
    code = "conflict"
    http_status = 409


class EtcdServerError(MeshError):
    code = "etcd_server"
    http_status = 500


class CatalogError(MeshError):
    code = "catalog"
    http_status = 404


class BlobError(MeshError):
    code = "blob"
    http_status = 502


class VariantBuildError(MeshError):
    code = "build"
    http_status = 500


class RuntimeLoadError(MeshError):
    code = "runtime_load"
    http_status = 500


class RequestError(MeshError):
    code = "bad_request"
    http_status = 400


class UnknownTask(RequestError):
    code = "unknown_task"
    http_status = 404


class UnknownTenant(RequestError):
    code = "unknown_tenant"
    http_status = 403


class BadTensor(RequestError):
    code = "bad_tensor"
    http_status = 400


class PayloadTooLarge(RequestError):
    code = "too_large"
    http_status = 413


class ImpossibleSLO(RequestError):
    code = "impossible_slo"
    http_status = 422


class ModelRejected(RequestError):
    """An uploaded model failed a check before anything ran it (``variant_store.model_check``). ``reason``
    is a short stable word (``too_large``, ``bad_protobuf``, ``opset``, ``custom_domain``, ``external_data``,
    ``initializer_bytes``, ``graph``, ``checker``, ...); the message names the node, tensor or number."""

    code = "bad_model"
    http_status = 422

    def __init__(self, message: str, *, reason: str = "bad_model", **details: Any) -> None:
        super().__init__(message, reason=reason, **details)
        self.reason = reason


class CascadeRefused(RequestError):
    """A cascade (issue 33) the variant store will not calibrate or register. ``reason``: ``unreachable`` (no
    threshold meets the target accuracy on the calibration half), ``stages`` (not variants of the task, or
    outputs of different classes), ``metric`` (not top-1), ``owner`` (stages of two tenants), ``rows``."""

    code = "bad_cascade"
    http_status = 422

    def __init__(self, message: str, *, reason: str = "bad_cascade", **details: Any) -> None:
        super().__init__(message, reason=reason, **details)
        self.reason = reason


class PipelineRefused(RequestError):
    """A pipeline (a task declared as a graph of other tasks, issue 33) the catalog will not register. ``reason``:
    ``unknown_task`` (a stage names no catalogued task), ``cycle`` (a stage is, through pipelines, the pipeline
    itself), ``signature`` (an output does not match the input it feeds: name, dtype or shape), ``table`` (a
    Switch's class table), ``graph`` (malformed), ``name`` (the task already has variants); when it is measured
    on labelled rows (``variant_store.pipeline_measure``): ``validation`` (the rows), ``metric`` (its first output
    is not one score per class), ``nested`` (a stage is itself a pipeline)."""

    code = "bad_pipeline"
    http_status = 422

    def __init__(self, message: str, *, reason: str = "graph", **details: Any) -> None:
        super().__init__(message, reason=reason, **details)
        self.reason = reason


class DeadlineExceeded(MeshError, TimeoutError):
    """The deadline passed before an answer. A ``TimeoutError`` too (so an ``OSError``), as Python's own timeouts
    are: a caller's ``except TimeoutError`` catches it; ``except MeshError`` still does. A handler that maps
    ``TimeoutError`` to something else must catch ``MeshError`` first."""

    code = "deadline"
    http_status = 504


class Overloaded(MeshError):
    code = "overloaded"
    http_status = 503


class QuotaExceeded(MeshError):
    """The tenant is over its rate or in-flight quota at the door it called (``edge_agent.quota``).
    ``retry_after_s``: whole seconds until the caller may try again (at least 1), sent as HTTP
    ``Retry-After``."""

    code = "quota_exceeded"
    http_status = 429

    def __init__(self, message: str, *, retry_after_s: int = 1, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = max(1, int(retry_after_s))


class NoRoute(MeshError):
    code = "no_route"
    http_status = 503


class PeerUnavailable(MeshError):
    code = "peer_down"
    http_status = 502


class EdgeStalled(PeerUnavailable):
    """The edge did not run the query: its process was stopped (SIGSTOP, a paused VM) while the query waited at its
    door, for longer than the query's budget (``edge_agent.stall_watch``). Nothing was run, so the query may be
    asked of another edge with what is left of its budget by the caller's clock (``mesh.Client([...])`` does)."""

    code = "stalled"
    http_status = 503


class ProtocolError(MeshError):
    """Bytes from a peer or from etcd that do not decode into what the reader expects. A decoder of untrusted
    input raises this and nothing else (``mesh.etcd.store.decode_json``, ``core_scheduler.state.records``), so
    its caller can ignore the value without guessing what else a hostile one might raise."""

    code = "protocol"
    http_status = 400


class PkiError(MeshError):
    """Local trust material (CA certificate or key, a key file, the revocation list) is missing or unusable:
    our fault, not the peer's."""

    code = "pki"
    http_status = 500


class Unauthenticated(MeshError):
    """A peer's credential does not prove an identity. ``reason`` is a short stable word (``no_certificate``,
    ``wrong_ca``, ``expired``, ``not_yet_valid``, ``revoked``, ``san``, ``eku``, ``ca_certificate``,
    ``curve_binding``, ``bad_certificate``) for logs and tests; callers are told only the code."""

    code = "unauthenticated"
    http_status = 401

    def __init__(self, message: str, *, reason: str = "unauthenticated", **details: Any) -> None:
        super().__init__(message, reason=reason, **details)
        self.reason = reason


class PermissionDenied(MeshError):
    """An authenticated identity asked for something it may not have (another kind of identity expected,
    another tenant's data, ...). ``reason`` as for :class:`Unauthenticated`."""

    code = "forbidden"
    http_status = 403

    def __init__(self, message: str, *, reason: str = "forbidden", **details: Any) -> None:
        super().__init__(message, reason=reason, **details)
        self.reason = reason


def _all_subclasses(cls: type[MeshError]) -> list[type[MeshError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[str, type[MeshError]] = {c.code: c for c in _all_subclasses(MeshError)}


def error_from_code(code: str, message: str) -> MeshError:
    """Rebuild an error received over the wire or HTTP from its code (unknown codes -> MeshError)."""
    cls = _BY_CODE.get(code, MeshError)
    if cls is TopologyError:
        return MeshError(message)
    return cls(message)



def error_from_reply(status: int, body: bytes, retry_after_s: int | None = None) -> MeshError:
    """The error an HTTP error reply carries (``{"code", "error"}``; a 429's ``Retry-After``, read by the
    caller, kept on its ``QuotaExceeded``), or a plain ``MeshError`` naming the status for a body not ours."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        data = None
    if isinstance(data, dict) and isinstance(data.get("code"), str) and isinstance(data.get("error"), str):
        err = error_from_code(data["code"], data["error"])
        if isinstance(err, QuotaExceeded) and retry_after_s is not None:  # the server's word, not the default
            err = QuotaExceeded(data["error"], retry_after_s=retry_after_s)
        return err
    return MeshError(f"HTTP {status}: {body[:200]!r}")
