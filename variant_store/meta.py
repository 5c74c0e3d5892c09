"""Variant metadata: the catalog's value type (``catalog/<task>/<variant_id>`` in etcd, JSON, schema 1).

A variant is one servable artefact of a task: a format (onnx / tflite / tensorrt), a precision
(fp32 / fp16 / int8), a measured accuracy on the task's held-out validation data, a size, and
profiles per hardware class. Accuracy is always measured, never copied from the parent.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["SCHEMA_VERSION", "LatencyStats", "Profile", "VariantMeta"]

SCHEMA_VERSION = 1
Format = Literal["onnx", "tflite", "tensorrt"]
Precision = Literal["fp32", "fp16", "int8"]


@dataclass(slots=True)
class LatencyStats:
    p50_ms: float
    p99_ms: float


@dataclass(slots=True)
class Profile:
    """What one variant costs on one hardware class (e.g. ``cpu-x86_64``, ``gpu-h100``)."""

    hardware_class: str
    load_ms: float
    latency: dict[int, LatencyStats]   # batch size -> stats
    peak_memory_bytes: int
    providers: list[str] = field(default_factory=list)  # execution providers actually in use
    measured_at: float = 0.0

    def compute_ms(self, batch: int) -> float:
        """Median latency at ``batch``, interpolated linearly between measured batch sizes."""
        sizes = sorted(self.latency)
        if batch <= sizes[0]:
            return self.latency[sizes[0]].p50_ms
        for lo, hi in itertools.pairwise(sizes):
            if batch <= hi:
                a, b = self.latency[lo].p50_ms, self.latency[hi].p50_ms
                return a + (b - a) * (batch - lo) / (hi - lo)
        top = sizes[-1]
        return self.latency[top].p50_ms * batch / top


@dataclass(slots=True)
class VariantMeta:
    task: str
    family: str                      # architecture family, e.g. "cnn-small"
    variant_id: str                  # unique within the task, e.g. "cnn-small.onnx.int8"
    format: Format
    precision: Precision
    runtime: str                     # "onnxruntime" | "tflite" | "tensorrt"
    blob_digest: str                 # sha256 hex of the model bytes
    size_bytes: int
    accuracy: float                  # measured on the held-out validation set, in [0, 1]
    metric: str = "top1"             # "top1" or "cosine"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    inputs: list[dict[str, Any]] = field(default_factory=list)   # [{"name","dtype","shape"}]
    outputs: list[dict[str, Any]] = field(default_factory=list)
    parent: str | None = None        # variant_id of the FP32 model it was generated from
    shared_base_digest: str | None = None  # backbone blob for backbone + head variants
    owner: str = "public"            # "public" or a tenant name
    profiles: dict[str, Profile] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for prof in out["profiles"].values():
            prof["latency"] = {str(b): s for b, s in prof["latency"].items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VariantMeta:
        data = dict(data)
        profiles = {}
        for hw, p in (data.pop("profiles", None) or {}).items():
            lat = {int(b): LatencyStats(**s) for b, s in p.get("latency", {}).items()}
            profiles[hw] = Profile(**{**p, "latency": lat})
        return cls(**data, profiles=profiles)
