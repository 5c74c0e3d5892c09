"""Plain value types shared by the data plane, the SDK, the HTTP front and the wire protocol.

These are the contracts between transports and the one place where a query is served
(``edge_agent.dataplane``). They carry the tenant from the first byte.

Each value is checked once, here, by the type that holds it, and later stages trust the type:
an ``SLO`` cannot be built out of range (``SLO.parse`` is what every decoder calls: the HTTP
parameters and both ZeroMQ decoders); inputs are checked against a task's signature by
``check_inputs`` at the data plane's door; a query's id and deadline are set once, by
``InferRequest.entering``, where it enters the mesh.

Deadlines are local: ``InferRequest.deadline`` is an instant on this process's monotonic clock
(``mesh.clock.monotonic``). It never crosses the wire as an instant: a hop sends the budget left
(``remaining_ms()`` at send) and the next hop sets its own deadline from it on arrival, so sites'
wall clocks are never compared (see ``mesh.zmq.protocol``).

Tensors are numpy arrays on the servers' side; the SDK's base install has no numpy, and imports this module, so
numpy is imported by the functions that check arrays, not here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

from mesh import clock
from mesh.cache import BoundedCache
from mesh.errors import BadTensor, RequestError

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "BEST_EFFORT_GRACE_MS",
    "DEFAULT_PREFER",
    "DEFAULT_TENANT",
    "MAX_DIM",
    "MAX_LATENCY_MS",
    "MAX_REQUEST_ID",
    "PREFERS",
    "SLO",
    "TIERS",
    "TIER_RANK",
    "InferRequest",
    "InferResponse",
    "Prefer",
    "StageInfo",
    "TaskSignature",
    "TensorSpec",
    "Tier",
    "Timing",
    "check_inputs",
    "new_request_id",
    "shape_fits",
]

DEFAULT_TENANT = "public"
# The longest latency budget an SLO may ask for: an online query, not a job. A budget is also how long the query
# may hold its quota slot, queue rows and a forwarded hop's attention, so "no bound" let one caller park work for
# ever (issue 29); ten minutes covers a cold load of the largest variant many times over.
MAX_LATENCY_MS: Final = 600_000.0
# How far past its budget a best-effort query may be answered (given once, by the hop whose first decision was best
# effort: ``edge_agent.site_dataplane``; the reasons are in ``edge_agent.paths``). So no hop is ever handed more than
# ``MAX_LATENCY_MS`` plus this (``mesh.zmq.protocol_check`` refuses a forwarded budget over it).
BEST_EFFORT_GRACE_MS: Final = 500.0
# The longest request id a caller may choose (the V2 ``id``): it keys the door's trace store and rides in every
# hop's header, so its size is the caller's to choose only up to here. The ids the mesh makes are 24 characters.
MAX_REQUEST_ID: Final = 128
# no dimension of a tensor anyone sends is this long (every decoder refuses it)
MAX_DIM: Final = 1 << 31
# numpy refuses a shape whose non-zero dimensions multiply, in bytes, past its index type (2**63), even when
# another dimension is 0 and the tensor holds nothing ("array is too big"): at 16 bytes an element, the widest
_MAX_ELEMENTS: Final = 1 << 59


def shape_fits(dims: Sequence[int]) -> bool:
    """Whether a tensor of ``dims`` is one numpy can hold: every dimension in ``[0, MAX_DIM)`` and the product
    of the non-zero ones below ``2**59`` elements. The decoders of both wire formats ask this before they shape
    what they read, so a lying shape is the caller's 400 (or protocol error), never a ``ValueError`` deep in
    numpy."""
    count = 1
    for d in dims:
        if not 0 <= d < MAX_DIM:
            return False
        if d:
            count *= d
            if count >= _MAX_ELEMENTS:
                return False
    return True
Prefer = Literal["latency", "accuracy", "refuse"]
PREFERS: Final[tuple[Prefer, ...]] = get_args(Prefer)
DEFAULT_PREFER: Final[Prefer] = "latency"
Tier = Literal["edge", "middle", "core"]
TIERS: Final[tuple[Tier, ...]] = get_args(Tier)  # from the edge inwards
TIER_RANK: Final[Mapping[Tier, int]] = {t: i for i, t in enumerate(TIERS)}  # 0 at the edge, as TIERS


def _finite(name: str, v: object) -> float:
    if type(v) is not float:
        # bool is an int: a flag must never pass as a number
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise RequestError(f"SLO {name} must be a finite number, got {v!r}")
        try:
            v = float(v)
        except OverflowError as exc:  # an int beyond float's range
            raise RequestError(f"SLO {name} must be a finite number, got {v!r}") from exc
    if v - v != 0.0:  # inf - inf and nan - nan are nan
        raise RequestError(f"SLO {name} must be a finite number, got {v!r}")
    return v


def _latency_error(latency: float) -> str:
    if latency - latency != 0.0:  # inf or nan
        return f"SLO latency_ms must be a finite number, got {latency!r}"
    if latency <= 0.0:
        return f"SLO latency_ms must be positive, got {latency!r}"
    return f"SLO latency_ms must be at most {MAX_LATENCY_MS:.0f} (ten minutes), got {latency!r}"


@dataclass(frozen=True, slots=True)
class SLO:
    """What the caller asks for. ``latency_ms`` is end-to-end from the edge's receipt.

    Always valid: a positive budget of at most ``MAX_LATENCY_MS``, ``min_accuracy`` in [0, 1], a non-negative finite
    ``max_cost`` or none, one of ``PREFERS``; numbers are stored as floats. Anything else raises
    ``RequestError`` on construction (a wire decoder translates it to ``ProtocolError``)."""

    latency_ms: float
    min_accuracy: float = 0.0
    max_cost: float | None = None
    prefer: Prefer = DEFAULT_PREFER

    def __post_init__(self) -> None:
        # the one SLO validator: HTTP parameters, both ZeroMQ decoders and code all land here
        latency, acc, cost = self.latency_ms, self.min_accuracy, self.max_cost
        if type(latency) is not float or type(acc) is not float or (cost is not None and type(cost) is not float):
            latency, acc = _finite("latency_ms", latency), _finite("min_accuracy", acc)
            cost = None if cost is None else _finite("max_cost", cost)
            object.__setattr__(self, "latency_ms", latency)
            object.__setattr__(self, "min_accuracy", acc)
            object.__setattr__(self, "max_cost", cost)
        if not 0.0 < latency <= MAX_LATENCY_MS:
            raise RequestError(_latency_error(latency))
        if not 0.0 <= acc <= 1.0:
            raise RequestError(f"SLO min_accuracy must be in [0, 1], got {acc!r}")
        if cost is not None and not 0.0 <= cost < math.inf:
            raise RequestError(f"SLO max_cost must be non-negative and finite, got {cost!r}")
        if self.prefer not in PREFERS:
            raise RequestError(f"SLO prefer must be one of {list(PREFERS)}, got {self.prefer!r}")

    @classmethod
    def parse(cls, latency_ms: object, min_accuracy: object, max_cost: object, prefer: object) -> SLO:
        """The SLO these decoded values describe (``max_cost`` None: no ceiling); ``RequestError``
        saying which value is wrong otherwise. Callers repeat their SLO query after query, so
        one seen before comes from a small cache instead of being built and checked again."""
        # exact types only: 1 and True hash and compare equal to 1.0, but are not the same input
        if type(latency_ms) is float and type(min_accuracy) is float and type(prefer) is str \
                and (max_cost is None or type(max_cost) is float):
            key = (latency_ms, min_accuracy, max_cost, prefer)
            slo = _SLOS.get(key)
            if slo is None:
                slo = _SLOS.put(key, cls(latency_ms, min_accuracy, max_cost, prefer))  # type: ignore[arg-type]
            return slo
        return cls(latency_ms, min_accuracy, max_cost, prefer)  # type: ignore[arg-type]


# SLO is frozen, so equal ones can be shared: building and checking one costs more than a lookup,
# and callers repeat a handful of SLOs query after query
_SLOS: BoundedCache[tuple[float, float, float | None, str], SLO] = BoundedCache(1024)


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


def _fmt(shape: Sequence[int]) -> str:
    return "(" + ", ".join("N" if d == -1 else str(d) for d in shape) + ")"


def check_inputs(specs: Sequence[TensorSpec], inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``inputs`` checked against ``specs`` (names, dtypes, ranks and fixed sizes, -1 = any size,
    at least one row, one batch: every input whose spec's first dimension is the batch (-1) has the same
    number of rows): C-contiguous arrays in spec order, or ``BadTensor`` naming the tensor.

    The one input check, made at the data plane's door (and by a runtime called directly);
    what has passed it is not checked again on the same hop. The batch check is here because the batcher
    concatenates every input of the requests it merges, tenants mixed: inputs that disagree on their rows
    would fail the whole batch, every other caller's request in it included."""
    ndarray = _NDARRAY[0] if _NDARRAY else _ndarray()
    out: dict[str, np.ndarray] = {}
    if len(inputs) == len(specs):
        # the common case in a few comparisons: exact arrays, the spec's dtype and shape, one batch
        # the batch's rows once an input has set them; -1: one input, nothing to agree with (the agreement costs
        # about 70 ns per input of a multi-input task, measured here; under 30 ns for one input)
        rows = 0 if len(specs) > 1 else -1
        for spec in specs:
            arr = inputs.get(spec.name)
            if type(arr) is not ndarray:
                break
            shape, want = arr.shape, spec.shape
            if (arr.dtype != (_DTYPES.get(spec.dtype) or _dtype(spec.dtype)) or len(shape) != len(want)
                    or not arr.flags.c_contiguous or (shape and not shape[0])):
                break
            i = 0
            for w in want:  # an index, not zip(): this runs on every query
                if w != -1 and w != shape[i]:
                    break
                i += 1
            else:
                if rows >= 0 and want and want[0] == -1:
                    if rows and shape[0] != rows:
                        break  # inputs that disagree on their rows: the checked path below says which
                    rows = shape[0]
                out[spec.name] = arr
                continue
            break
        else:
            return out
    return _check_inputs(specs, inputs)


def _one_batch(specs: Sequence[TensorSpec], arrays: Mapping[str, np.ndarray]) -> bool:
    """Whether every input whose spec's first dimension is the batch (-1) has the same number of rows."""
    rows = -1
    for spec in specs:
        if spec.shape and spec.shape[0] == -1:
            n = arrays[spec.name].shape[0]
            if rows == -1:
                rows = n
            elif n != rows:
                return False
    return True


_NDARRAY: list[type[np.ndarray]] = []


def _ndarray() -> type[np.ndarray]:
    """``numpy.ndarray``, imported on first use (a server's path: the SDK on a device may have no numpy, see the
    module docstring) and kept: an ``import`` statement per query costs more than the check itself."""
    if not _NDARRAY:
        import numpy as np

        _NDARRAY.append(np.ndarray)
    return _NDARRAY[0]


def _check_inputs(specs: Sequence[TensorSpec], inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    import numpy as np

    names = [s.name for s in specs]
    missing = [n for n in names if n not in inputs]
    if missing:
        raise BadTensor(f"missing input tensor(s) {missing}; expected {names}", expected=names, got=sorted(inputs))
    extra = sorted(set(inputs) - set(names))
    if extra:
        raise BadTensor(f"unknown input tensor(s) {extra}; expected {names}", expected=names, got=sorted(inputs))
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        arr = inputs[spec.name]
        if not isinstance(arr, np.ndarray):
            raise BadTensor(f"input '{spec.name}': expected a numpy array, got {type(arr).__name__}")
        if arr.dtype != _dtype(spec.dtype):
            raise BadTensor(f"input '{spec.name}': expected dtype {spec.dtype}, got {arr.dtype}",
                            tensor=spec.name, expected=spec.dtype, got=str(arr.dtype))
        ok = arr.ndim == len(spec.shape) and all(
            want in (-1, got) for want, got in zip(spec.shape, arr.shape, strict=True))
        if not ok or (arr.ndim and arr.shape[0] == 0):
            raise BadTensor(f"input '{spec.name}': expected shape {_fmt(spec.shape)}, got {tuple(arr.shape)}",
                            tensor=spec.name, expected=list(spec.shape), got=list(arr.shape))
        out[spec.name] = np.ascontiguousarray(arr)
    if not _one_batch(specs, out):
        batch = {s.name: int(out[s.name].shape[0]) for s in specs if s.shape and s.shape[0] == -1}
        raise BadTensor(f"inputs disagree on the batch (first) dimension: {batch}; every batched input needs the "
                        f"same number of rows", rows=batch)
    return out


# np.dtype("float32") parses its argument on every call; a spec names one of a handful of dtypes
_DTYPES: dict[str, np.dtype[Any]] = {}


def _dtype(name: str) -> np.dtype[Any]:
    dt = _DTYPES.get(name)
    if dt is None:
        import numpy as np

        dt = _DTYPES[name] = np.dtype(name)  # bounded: only specs' dtype names are looked up
    return dt


def new_request_id() -> str:
    """A fresh request id: 96 bits from the kernel's generator, 24 hex characters.

    Not a per-process prefix plus a counter (what it was): agents forked from one process shared the prefix
    and the count, so ids collided across them, and a tenant reading its own ids saw how many queries everyone
    else sent in between. ``os.urandom`` costs about 0.3-0.4 µs more per id than the counter did (measured
    here: 0.46-0.61 µs against 0.13-0.19 µs), once per query; it draws fresh in a forked child, unlike a seeded
    PRNG, and its ids cannot be predicted from earlier ones."""
    return os.urandom(12).hex()


@dataclass(slots=True)
class InferRequest:
    """One query as the data plane sees it. ``deadline`` is an instant on *this process's*
    monotonic clock (``mesh.clock.monotonic``), meaningless elsewhere: a query entering the mesh
    gets it from :meth:`entering`; one arriving over the wire from the budget its sender had left
    (the decoder sets it). ``sent_at`` is the previous hop's wall-clock send time as it reported
    it (0.0: the query did not arrive over the wire): for diagnostics only, never compared.
    ``traceparent`` is set only on a query whose decisions are traced."""

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
    sent_at: float = 0.0
    # W3C traceparent of a traced query (``mesh.tracecontext``); None: not traced (the common case)
    traceparent: str | None = None
    # the version of a tenant's task the caller pinned (``parameters.version``; issue 34): routed at the door only,
    # which names the variant it forwards to, so it never travels on the wire
    version: int | None = None

    @classmethod
    def entering(cls, task: str, inputs: dict[str, np.ndarray], slo: SLO, tenant: str = DEFAULT_TENANT,
                 request_id: str | None = None, *, now: float | None = None) -> InferRequest:
        """A query as it enters the mesh: the one place its id (the caller's, else a fresh one) and
        its deadline (the SLO's whole budget from ``now``, a monotonic instant) are set. A caller's id is
        at most ``MAX_REQUEST_ID`` printable characters (``RequestError`` otherwise): it keys the door's
        traces and is echoed in replies and logs."""
        start = clock.monotonic() if now is None else now
        if request_id and (len(request_id) > MAX_REQUEST_ID or not request_id.isprintable()):
            raise RequestError(f"request id must be at most {MAX_REQUEST_ID} printable characters, got "
                               f"{len(request_id)} characters, printable: {request_id.isprintable()}")
        return cls(task, inputs, slo, tenant, request_id or new_request_id(), start + slo.latency_ms / 1000.0)

    @property
    def rows(self) -> int:
        """The rows (batch) the request brings: its inputs' leading dimension, 1 for scalars."""
        return max((int(a.shape[0]) for a in self.inputs.values() if a.ndim), default=1)

    def remaining_ms(self, now: float | None = None) -> float:
        """Budget left at monotonic instant ``now`` (default: now), in ms; negative once past."""
        return (self.deadline - (clock.monotonic() if now is None else now)) * 1000.0


@dataclass(slots=True)
class Timing:
    """Milliseconds spent in each part of the path, as seen by the replying edge."""

    network_ms: float = 0.0
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class StageInfo:
    """One stage of a cascade (``edge_agent.cascade_exec``) or of a pipeline (``edge_agent.pipeline_exec``) as it
    ran for a query (issue 33): ``stage`` counts from 1; ``rows`` it ran, ``answered`` of them; ``confidence`` per
    row it ran (``()`` for the last stage, which answers every row it gets); ``total_ms`` from the door's send to
    its answer; ``task``: a pipeline stage's own task (``""`` for a cascade's, whose stages serve the query's)."""

    stage: int
    site: str
    variant: str
    rows: int
    answered: int
    confidence: tuple[float, ...] = ()
    total_ms: float = 0.0
    compute_ms: float = 0.0
    task: str = ""


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
    # a traced query's hop records from this hop inwards (JSON-able maps, ``edge_agent.traces``);
    # None when not traced
    trace: list[dict[str, Any]] | None = None
    # served through a backbone shared by several heads: the distinct tenants in its batch (1 or
    # more); 0 when no shared backbone was involved
    backbone_tenants: int = 0
    # answered past its budget (the SLO's latency_ms from the query's entry), best effort or not: set by the door,
    # which measured the whole time (``edge_agent.site_dataplane``); a late answer is never reported as met
    late: bool = False
    # answered by a cascade (reason cascade_local / cascade_escalated): its id and each stage that ran, in order
    cascade: str = ""
    stages: tuple[StageInfo, ...] = ()
