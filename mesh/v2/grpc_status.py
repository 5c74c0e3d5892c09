"""The gRPC status of each tiermesh error code: the one table the edge's gRPC front answers with (and an SDK gRPC
transport reads back, with the code itself in the ``tiermesh-code`` trailer), beside ``http_status`` in
:mod:`mesh.errors`. Numbers are gRPC's (``grpc/status.h``), so no gRPC library is needed to read them.

    code             gRPC status              why that one
    bad_request      INVALID_ARGUMENT (3)     malformed request, tensor, parameter, undecodable message
    bad_tensor       INVALID_ARGUMENT (3)
    protocol         INVALID_ARGUMENT (3)
    bad_config       INVALID_ARGUMENT (3)
    bad_topology     INVALID_ARGUMENT (3)
    bad_model        INVALID_ARGUMENT (3)     an uploaded model a check refused (``reason`` says which)
    bad_cascade      FAILED_PRECONDITION (9)  no threshold reaches the target on the validation rows, as
                                              impossible_slo: well formed, refused by what the data says
    bad_pipeline     INVALID_ARGUMENT (3)     a pipeline graph refused at registration (cycle, signature, ...)
    unknown_task     NOT_FOUND (5)            also another tenant's private task: the same answer
    catalog          NOT_FOUND (5)
    impossible_slo   FAILED_PRECONDITION (9)  the request is well formed; the mesh's state (no variant reaches the
                                              SLO, prefer=refuse) refuses it; OUT_OF_RANGE is for reading past an end
    deadline         DEADLINE_EXCEEDED (4)
    too_large        RESOURCE_EXHAUSTED (8)   as gRPC's own "message larger than max"
    overloaded       RESOURCE_EXHAUSTED (8)
    quota_exceeded   RESOURCE_EXHAUSTED (8)   ``retry-after`` trailer in seconds, as REST's Retry-After
    unauthenticated  UNAUTHENTICATED (16)
    forbidden        PERMISSION_DENIED (7)
    unknown_tenant   PERMISSION_DENIED (7)
    conflict         ABORTED (10)
    store, store_down, no_route, peer_down, stalled, blob
                     UNAVAILABLE (14)         worth trying again, or at another edge
    anything else    INTERNAL (13)

Read back (the SDK's gRPC transport, :mod:`mesh.grpc_transport`): the ``tiermesh-code`` trailer names the error;
a status that comes without it (grpclib's own, a proxy's) is read as the most general code of that status,
:func:`code_of_status`.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CODE_OF_STATUS", "CODE_TRAILER", "INTERNAL", "RETRY_TRAILER", "STATUS_OF_CODE", "code_of_status",
           "status_of"]

INTERNAL: Final = 13
CODE_TRAILER: Final = "tiermesh-code"  # the error's tiermesh code, beside its status
RETRY_TRAILER: Final = "retry-after"  # quota_exceeded: when to come back, whole seconds (REST's Retry-After)
STATUS_OF_CODE: Final[dict[str, int]] = {
    "bad_request": 3, "bad_tensor": 3, "protocol": 3, "bad_config": 3, "bad_topology": 3, "bad_model": 3,
    "bad_pipeline": 3,
    "unknown_task": 5, "catalog": 5,
    "impossible_slo": 9, "bad_cascade": 9,
    "deadline": 4,
    "too_large": 8, "overloaded": 8, "quota_exceeded": 8,
    "unauthenticated": 16,
    "forbidden": 7, "unknown_tenant": 7,
    "conflict": 10,
    "store": 14, "store_down": 14, "no_route": 14, "peer_down": 14, "stalled": 14, "blob": 14,
    "etcd_server": INTERNAL, "build": INTERNAL, "runtime_load": INTERNAL, "pki": INTERNAL, "internal": INTERNAL,
}


def status_of(code: str) -> int:
    """The gRPC status number of a tiermesh error code (INTERNAL for one not in the table)."""
    return STATUS_OF_CODE.get(code, INTERNAL)


# a status without the code trailer: the most general code that answers with it (INTERNAL's: internal)
CODE_OF_STATUS: Final[dict[int, str]] = {
    3: "bad_request", 4: "deadline", 5: "unknown_task", 7: "forbidden", 8: "overloaded", 9: "impossible_slo",
    10: "conflict", 14: "peer_down", 16: "unauthenticated",
}


def code_of_status(status: int) -> str:
    """The tiermesh code read from a gRPC status that carries none in its trailers (``internal`` for the rest)."""
    return CODE_OF_STATUS.get(status, "internal")
