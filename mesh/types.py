"""Plain value types shared by the data plane, the SDK, the HTTP front and the wire protocol.

These are the contracts between transports and the one place where a query is served
(``edge_agent.dataplane``). They carry the tenant from the first byte.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = [
    "DEFAULT_TENANT",
    "SLO",
    "InferRequest",
    "InferResponse",
    "Prefer",
    "TaskSignature",
    "TensorSpec",
    "Timing",
]

DEFAULT_TENANT = "public"
Prefer = Literal["latency", "accuracy", "refuse"]


@dataclass(frozen=True, slots=True)
class SLO:
    """What the caller asks for. ``latency_ms`` is end-to-end from the edge's receipt."""

    latency_ms: float
    min_accuracy: float = 0.0
    max_cost: float | None = None
    prefer: Prefer = "latency"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str          # numpy dtype name, e.g. "float32"
    shape: tuple[int, ...]  # -1 for a dynamic dimension (the batch)


@dataclass(frozen=True, slots=True)
class TaskSignature:
    task: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    metric: str = "top1"  # "top1" or "cosine"


@dataclass(slots=True)
class InferRequest:
    """One query as the data plane sees it. ``deadline`` is absolute, on ``time.time()``'s clock."""

    task: str
    inputs: dict[str, np.ndarray]
    slo: SLO
    tenant: str = DEFAULT_TENANT
    request_id: str = ""
    deadline: float = 0.0
    hops: list[str] = field(default_factory=list)
    # where the policy already decided to send it (set by the first hop when forwarding)
    target_site: str | None = None
    target_variant: str | None = None

    def remaining_ms(self, now: float | None = None) -> float:
        return (self.deadline - (time.time() if now is None else now)) * 1000.0


@dataclass(slots=True)
class Timing:
    """Milliseconds spent in each part of the path, as seen by the replying edge."""

    network_ms: float = 0.0
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(slots=True)
class InferResponse:
    request_id: str
    outputs: dict[str, np.ndarray]
    site: str                 # where it was served
    variant: str              # which variant served it
    accuracy: float           # the accuracy that variant measured on its validation set
    reason: str               # short decision code, e.g. "local_ok", "forward_accuracy", "best_effort_latency"
    best_effort: bool = False  # True when no candidate met the SLO and one was served anyway
    tenant: str = DEFAULT_TENANT
    timing: Timing = field(default_factory=Timing)
    hops: list[str] = field(default_factory=list)
