"""tiermesh: a model-less inference serving mesh. The public SDK surface.

    from mesh import Client
    with Client("https://127.0.0.1:8000", cert="acme.pem", key="acme-key.pem", ca="ca.pem") as c:
        r = c.infer("digit-classification", x, latency_ms=20, min_accuracy=0.97)
        r.output(), r.site, r.variant, r.accuracy, r.reason, r.timing

Outputs are numpy arrays where numpy is installed; the base install (``pip install tiermesh``) has no numpy and
returns :class:`Tensor` objects (``mesh.v2.sdk``).

The client and the types are imported on first use (PEP 562): a server process that imports ``mesh.errors`` or
``mesh.etcd`` runs this file first, and must not pay for the SDK's HTTP client (aiohttp's client, TLS context,
numpy) unless it uses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mesh.errors import (
    BadTensor,
    CascadeRefused,
    DeadlineExceeded,
    EdgeStalled,
    ImpossibleSLO,
    MeshError,
    ModelRejected,
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
from mesh.lazy import lazy_exports

if TYPE_CHECKING:
    from mesh.client import AsyncClient, Client, InferResult
    from mesh.types import SLO, Timing
    from mesh.v2.plain import Tensor

_LAZY = {"AsyncClient": "mesh.client", "Client": "mesh.client", "InferResult": "mesh.client", "SLO": "mesh.types",
         "Tensor": "mesh.v2.plain", "Timing": "mesh.types"}

__all__ = [
    "SLO",
    "AsyncClient",
    "BadTensor",
    "CascadeRefused",
    "Client",
    "DeadlineExceeded",
    "EdgeStalled",
    "ImpossibleSLO",
    "InferResult",
    "MeshError",
    "ModelRejected",
    "NoRoute",
    "Overloaded",
    "PayloadTooLarge",
    "PeerUnavailable",
    "PermissionDenied",
    "QuotaExceeded",
    "RequestError",
    "Tensor",
    "Timing",
    "Unauthenticated",
    "UnknownTask",
    "UnknownTenant",
]
__version__ = "0.1.0"


__getattr__, __dir__ = lazy_exports("mesh", _LAZY, globals())
