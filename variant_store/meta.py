"""Variant metadata: the catalog's value type (``catalog/<task>/<variant_id>`` in etcd, JSON, schema 1).

A variant is one servable artefact of a task: a format (onnx / tflite / tensorrt), a precision
(fp32 / fp16 / int8), a measured accuracy on the task's held-out validation data, a size, and
profiles per hardware class. Accuracy is always measured, never copied from the parent.

:meth:`VariantMeta.from_json` reads an entry from etcd, where anything may have been written: each field is
checked for its type and range before it is used, and anything malformed raises ``ValueError``, only that.
Fields it does not know (a newer writer's) are dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal, get_args

__all__ = ["PUBLIC", "SCHEMA_VERSION", "LatencyStats", "Profile", "VariantMeta"]

PUBLIC = "public"  # the owner of what every tenant may run (any other owner is a tenant name)

SCHEMA_VERSION = 1
Format = Literal["onnx", "tflite", "tensorrt"]
Precision = Literal["fp32", "fp16", "int8"]
_MAX_COUNT = 2**53     # bytes and batch sizes: exact as float64 and int64, as the policies' tables hold them
_MAX_MS = 1e9          # a load or a run of over eleven days is no measurement
_MAX_TEXT = 4096


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
    owner: str = PUBLIC              # PUBLIC or a tenant name
    profiles: dict[str, Profile] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION
    # issue 34 item 3 (variant_store.versions): which registration of its task made it (1, 2, ...), and the share
    # of the task's traffic its version draws (mirrored from versions/<task> so routing needs no other watch):
    # 0 while its version builds or retires, 1 when it alone is active
    version: int = 1
    share: float = 1.0

    def names(self, digest: str) -> bool:
        """Whether this variant is built on blob ``digest`` (its own model bytes or its shared backbone)."""
        return digest in (self.blob_digest, self.shared_base_digest)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for prof in out["profiles"].values():
            prof["latency"] = {str(b): s for b, s in prof["latency"].items()}
        return out

    @classmethod
    def from_json(cls, data: Any) -> VariantMeta:
        """The entry ``data`` (as :meth:`to_json` writes it); ``ValueError`` for anything malformed."""
        d = _object(data, "variant")
        checked = {name: read(d[name], name) for name, read in _FIELDS.items() if name in d}
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
                   and f.name not in checked]
        if missing:
            raise ValueError(f"a variant entry needs {missing}")
        return cls(**checked, profiles={_text(hw, "hardware class"): _profile(p)
                                        for hw, p in _object(d.get("profiles") or {}, "profiles").items()})


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, not a {type(value).__name__}")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise ValueError(f"{name} must be a string of at most {_MAX_TEXT} characters")
    return value


def _opt_text(value: Any, name: str) -> str | None:
    return None if value is None else _text(value, name)


def _number(value: Any, name: str, hi: float) -> float:
    # a bool is an int to Python, never a number here; NaN fails the comparison, a huge int compares exactly
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= hi:
        raise ValueError(f"{name} must be a number in [0, {hi:g}]")
    return float(value)


def _count(value: Any, name: str, lo: int = 0) -> int:
    # written as a float (a measured size): taken, truncated, as readers always did
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= _MAX_COUNT:
        raise ValueError(f"{name} must be a count in [{lo}, 2**53]")
    return int(value)


def _one_of(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def check(value: Any, name: str) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name} must be one of {choices}")
        return value
    return check


def _list(item: Callable[[Any, str], Any]) -> Callable[[Any, str], list[Any]]:
    def check(value: Any, name: str) -> list[Any]:
        if not isinstance(value, list):
            raise ValueError(f"{name} must be a list, not a {type(value).__name__}")
        return [item(x, name) for x in value]
    return check


def _tensor(value: Any, name: str) -> dict[str, Any]:
    """``{"name", "dtype", "shape"}`` of an input or output (the task's signature checks dtypes; this the shape)."""
    d = _object(value, name)
    shape = d.get("shape")
    if not isinstance(shape, list) or len(shape) > 32 or not all(
            isinstance(x, int) and not isinstance(x, bool) and -1 <= x <= _MAX_COUNT for x in shape):
        raise ValueError(f"{name}: a shape is a list of at most 32 sizes (-1: any)")
    return {"name": _text(d.get("name"), f"{name} name"), "dtype": _text(d.get("dtype"), f"{name} dtype"),
            "shape": shape}


def _profile(value: Any) -> Profile:
    p = _object(value, "profile")
    latency = {_batch(b): LatencyStats(p50_ms=_number(_object(st, "latency").get("p50_ms"), "p50_ms", _MAX_MS),
                                       p99_ms=_number(st.get("p99_ms"), "p99_ms", _MAX_MS))
               for b, st in _object(p.get("latency") or {}, "latency").items()}
    if not latency:  # compute_ms() interpolates between measured batch sizes: it needs one at least
        raise ValueError("a profile holds the latency of one batch size at least")
    return Profile(hardware_class=_text(p.get("hardware_class"), "hardware_class"),
                   load_ms=_number(p.get("load_ms"), "load_ms", _MAX_MS), latency=latency,
                   peak_memory_bytes=_count(p.get("peak_memory_bytes"), "peak_memory_bytes"),
                   providers=_list(_text)(p.get("providers") or [], "providers"),
                   measured_at=_number(p.get("measured_at", 0.0), "measured_at", 1e12))


def _batch(key: str) -> int:
    if not (key.isascii() and key.isdigit()) or len(key) > 7 or int(key) < 1:
        raise ValueError("a profiled batch size is a positive integer")
    return int(key)


# How each field but ``profiles`` is read
_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "task": _text, "family": _text, "variant_id": _text, "runtime": _text, "blob_digest": _text, "metric": _text,
    "owner": _text, "parent": _opt_text, "shared_base_digest": _opt_text,
    "format": _one_of(get_args(Format)), "precision": _one_of(get_args(Precision)),
    "size_bytes": _count, "accuracy": lambda v, n: _number(v, n, 1.0),
    "batch_sizes": _list(lambda v, n: _count(v, n, lo=1)), "inputs": _list(_tensor), "outputs": _list(_tensor),
    "schema": lambda v, n: _count(v, n, lo=1),
    "version": lambda v, n: _count(v, n, lo=1), "share": lambda v, n: _number(v, n, 1.0),
}
