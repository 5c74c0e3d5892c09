"""tiermesh: a model-less inference serving mesh. The public SDK surface.

    from mesh import Client
    with Client("https://127.0.0.1:8000", cert="acme.pem", key="acme-key.pem", ca="ca.pem") as c:
        r = c.infer("digit-classification", x, latency_ms=20, min_accuracy=0.97)
        r.output(), r.site, r.variant, r.accuracy, r.reason, r.timing
"""

from mesh.client import AsyncClient, Client, InferResult
from mesh.errors import (
    BadTensor,
    DeadlineExceeded,
    ImpossibleSLO,
    MeshError,
    NoRoute,
    Overloaded,
    PayloadTooLarge,
    PeerUnavailable,
    PermissionDenied,
    QuotaExceeded,
    RequestError,
    Unauthenticated,
    UnknownTask,
    UnknownTenant,
)
from mesh.types import SLO, Timing

__all__ = [
    "SLO",
    "AsyncClient",
    "BadTensor",
    "Client",
    "DeadlineExceeded",
    "ImpossibleSLO",
    "InferResult",
    "MeshError",
    "NoRoute",
    "Overloaded",
    "PayloadTooLarge",
    "PeerUnavailable",
    "PermissionDenied",
    "QuotaExceeded",
    "RequestError",
    "Timing",
    "Unauthenticated",
    "UnknownTask",
    "UnknownTenant",
]
__version__ = "0.1.0"
