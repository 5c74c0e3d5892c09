"""Tenants' model builds (issue 34 item 1), as etcd holds them and the edge's model API shows them: pure types, their
JSON, the state rules, and the bounded scan of an uploaded validation set.

Two records per build, split by who writes them (``mesh.etcd.keys``, ``mesh.etcd.rbac``):

- :class:`BuildRequest` at ``builds/<tenant>/<id>``: what a door admitted (the task, the family, the digests of the
  parent model and the validation set in the tenant's data area, and the task's accuracy bar when the tenant declared
  one). Written once; any site may write ``builds/``.
- :class:`BuildState` at ``buildstate/<id>``: the build's state, progress, each variant's results and the error; once
  done, the version it made and whether traffic moved to it (``active``) or not (``held``) and why.
  Only the variant store writes ``buildstate/``, so a site cannot mark a build done with results nobody measured.

States: ``queued`` (no state record yet) -> ``running`` (the store claimed it) -> ``done`` | ``failed``. Every change
is a compare-and-swap (:func:`transition_ok` says which are allowed); ``done`` and ``failed`` never change again. A
``running`` build whose record was not touched for ``stale_s`` (its store died mid-build) may be claimed again
(:func:`claimable`).

Units and conventions (one place): times are the writer's wall clock in epoch seconds; ``progress`` and accuracies
(``min_accuracy``, a variant's ``accuracy``) are fractions in [0, 1]; sizes are bytes; latencies are milliseconds (p50)
per batch size per hardware class.

Both records are decoded as hostile input (a site wrote one, and etcd is shared): ``from_json`` raises
``ProtocolError`` and nothing else, whatever the value.
"""

from __future__ import annotations

import math
import re
import zipfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast, get_args

from mesh.errors import ProtocolError, RequestError
from mesh.fields import field as _get
from mesh.fields import integer as _int
from mesh.fields import number as _num
from mesh.fields import record

__all__ = ["BUILD_STATES", "SCHEMA", "BuildRequest", "BuildState", "BuildStateName", "ValidationSummary",
           "VariantResult", "VersionOutcome", "build_status", "claimable", "declared_accuracy", "is_build_id",
           "is_name", "scan_validation", "transition_ok"]

SCHEMA = 1
BuildStateName = Literal["queued", "running", "done", "failed"]
BUILD_STATES: tuple[str, ...] = get_args(BuildStateName)
VersionOutcome = Literal["", "active", "held"]  # a done build's version: "" before it is done (or an older record)
_VERSION_OUTCOMES: tuple[str, ...] = get_args(VersionOutcome)
TERMINAL = frozenset({"done", "failed"})
MAX_TEXT = 4000          # an error or a reason kept in a record (the sandbox quotes a stderr tail)
MAX_VARIANTS = 64
MAX_CLASSES = 32
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")  # no '.': variant ids are <family>.<kind>
_ID = re.compile(r"^[0-9a-f]{32}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_TEXT_DTYPES = "biuf"    # a validation set's x: numbers (bool, ints, floats); y: integer labels


def is_build_id(text: str) -> bool:
    """A build id: 32 lowercase hex characters (a uuid4's hex); also guards keys."""
    return bool(_ID.match(text))


def declared_accuracy(raw: str | None) -> float | None:
    """The accuracy bar a registration declares for its task (the ``min_accuracy`` query parameter): None when absent,
    else a number in [0, 1]; ``RequestError`` naming ``min_accuracy`` otherwise. The door's one check: the request
    carries the float, and its decoder (:meth:`BuildRequest.from_json`) checks the same range as hostile input."""
    if raw is None:
        return None
    try:
        v = float(raw)
    except (ValueError, OverflowError) as exc:
        raise RequestError(f"min_accuracy must be a number in [0, 1], got {raw[:40]!r}") from exc
    if not 0.0 <= v <= 1.0:  # nan fails both comparisons
        raise RequestError(f"min_accuracy must be a number in [0, 1], got {raw[:40]!r}")
    return v


def is_name(text: str) -> bool:
    """A task or family name a tenant may register: letters, digits, ``_`` and ``-`` (no ``.``: ids are
    ``<family>.<kind>``)."""
    return bool(_NAME.match(text))


# -- decoding helpers (each raises ProtocolError) ------------------------------------------------------------------

def _match(d: dict[str, Any], name: str, where: str, pattern: re.Pattern[str]) -> str:
    v = _get(d, name, str, where)
    if not pattern.match(v):
        raise ProtocolError(f"{where}: {name!r} = {v[:40]!r} is not valid")
    return str(v)


def _text(d: dict[str, Any], name: str, where: str) -> str:
    v = d.get(name, "")
    if not isinstance(v, str):
        raise ProtocolError(f"{where}: {name!r} is not text")
    return v[:MAX_TEXT]


def _object(value: Any, where: str) -> dict[str, Any]:
    return record(value, where, SCHEMA)


@dataclass(frozen=True, slots=True)
class BuildRequest:
    """What a door admitted (``builds/<tenant>/<id>``)."""

    build_id: str
    tenant: str
    task: str
    family: str
    model_digest: str
    model_bytes: int
    validation_digest: str
    validation_bytes: int
    rows: int
    door: str
    created: float
    min_accuracy: float | None = None  # the task's accuracy bar the tenant declared (None: none declared)

    def to_json(self) -> dict[str, Any]:
        out = {"schema": SCHEMA, **asdict(self)}
        if self.min_accuracy is None:
            del out["min_accuracy"]  # as a request written before the field: every reader decodes it
        return out

    @classmethod
    def from_json(cls, value: Any) -> BuildRequest:
        try:
            d = _object(value, "build request")
            w = f"build request {str(d.get('build_id'))[:40]}"
            return cls(build_id=_match(d, "build_id", w, _ID), tenant=_match(d, "tenant", w, _NAME),
                       task=_match(d, "task", w, _NAME), family=_match(d, "family", w, _NAME),
                       model_digest=_match(d, "model_digest", w, _DIGEST),
                       model_bytes=_int(d, "model_bytes", w, 1, 1 << 40),
                       validation_digest=_match(d, "validation_digest", w, _DIGEST),
                       validation_bytes=_int(d, "validation_bytes", w, 1, 1 << 40),
                       rows=_int(d, "rows", w, 2, 1 << 40), door=_match(d, "door", w, _NAME),
                       created=_num(d, "created", w, 0.0, 1e12),
                       min_accuracy=None if d.get("min_accuracy") is None
                       else _num(d, "min_accuracy", w, 0.0, 1.0))
        except ProtocolError:
            raise
        except Exception as exc:  # RecursionError, OverflowError...: whatever the value, one error type
            raise ProtocolError(f"build request: undecodable: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class VariantResult:
    """One built variant: its measured accuracy on the held-out rows, its size, and p50 latency per batch size on
    each hardware class that profiled it (the store's at first; sites add theirs in the catalog)."""

    variant: str
    format: str
    precision: str
    accuracy: float
    size_bytes: int
    latency_ms: dict[str, dict[int, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "format": self.format, "precision": self.precision,
                "accuracy": self.accuracy, "size_bytes": self.size_bytes,
                "latency_ms": {hw: {str(b): ms for b, ms in sorted(per.items())}
                               for hw, per in sorted(self.latency_ms.items())}}

    @classmethod
    def from_json(cls, value: Any) -> VariantResult:
        if not isinstance(value, dict):
            raise ProtocolError("build result: a variant is not a JSON object")
        w = "build result"
        lat = value.get("latency_ms", {})
        if not isinstance(lat, dict) or len(lat) > MAX_CLASSES:
            raise ProtocolError(f"{w}: latency_ms is not a small object")
        latency: dict[str, dict[int, float]] = {}
        for hw, per in lat.items():
            if not isinstance(per, dict) or len(per) > 16 or not _NAME.match(str(hw)):
                raise ProtocolError(f"{w}: latency of {str(hw)[:40]!r} is not an object of batch sizes")
            latency[hw] = {}
            for b, ms in per.items():
                if not (isinstance(b, str) and b.isdigit() and len(b) < 7) or isinstance(ms, bool) \
                        or not isinstance(ms, int | float) or not (math.isfinite(ms) and ms >= 0):
                    raise ProtocolError(f"{w}: latency {str(b)[:10]!r} of {hw!r} is not a batch size and ms")
                latency[hw][int(b)] = float(ms)
        return cls(variant=_match(value, "variant", w, re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")),
                   format=_match(value, "format", w, _NAME), precision=_match(value, "precision", w, _NAME),
                   accuracy=_num(value, "accuracy", w, -1.0, 1.0), size_bytes=_int(value, "size_bytes", w, 0, 1 << 40),
                   latency_ms=latency)


@dataclass(frozen=True, slots=True)
class BuildState:
    """A build's progress and outcome (``buildstate/<id>``), the store's alone."""

    build_id: str
    tenant: str
    state: BuildStateName
    stage: str = ""            # what the store does now: fetching, checking, building, cataloguing
    progress: float = 0.0
    variants: tuple[VariantResult, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()   # (kind, reason) of what was not built
    error: str = ""
    reason: str = ""           # a failure's stable word: a ModelRejected reason, task_owned, family_used, sandbox...
    worker: str = ""           # the store that runs it
    started: float = 0.0
    updated: float = 0.0
    version: int = 0           # done: the version of the task the build made (0: not yet, or an older record)
    version_state: VersionOutcome = ""  # done: "active" (traffic moved to it) or "held" (it did not)
    version_note: str = ""     # why, e.g. "best 0.91 < declared 0.95"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "build_id": self.build_id, "tenant": self.tenant, "state": self.state,
                "stage": self.stage, "progress": self.progress, "variants": [v.to_json() for v in self.variants],
                "skipped": [{"kind": k, "reason": r} for k, r in self.skipped], "error": self.error,
                "reason": self.reason, "worker": self.worker, "started": self.started, "updated": self.updated,
                "version": self.version, "version_state": self.version_state, "version_note": self.version_note}

    def but(self, **changes: Any) -> BuildState:
        return replace(self, **changes)

    @classmethod
    def from_json(cls, value: Any) -> BuildState:
        try:
            d = _object(value, "build state")
            w = f"build state {str(d.get('build_id'))[:40]}"
            state = _get(d, "state", str, w)
            if state not in BUILD_STATES or state == "queued":
                raise ProtocolError(f"{w}: state {state[:20]!r} is not running, done or failed")
            variants, skipped = _get(d, "variants", list, w), _get(d, "skipped", list, w)
            if len(variants) > MAX_VARIANTS or len(skipped) > MAX_VARIANTS:
                raise ProtocolError(f"{w}: more than {MAX_VARIANTS} variants or skipped kinds")
            pairs = []
            for s in skipped:
                if not isinstance(s, dict):
                    raise ProtocolError(f"{w}: a skipped kind is not an object")
                pairs.append((_text(s, "kind", w)[:100], _text(s, "reason", w)))
            version_state = _text(d, "version_state", w)
            if version_state not in _VERSION_OUTCOMES:
                raise ProtocolError(f"{w}: version_state {version_state[:20]!r} is not active or held")
            return cls(build_id=_match(d, "build_id", w, _ID), tenant=_match(d, "tenant", w, _NAME), state=state,
                       stage=_text(d, "stage", w)[:40], progress=_num(d, "progress", w, 0.0, 1.0),
                       variants=tuple(VariantResult.from_json(v) for v in variants), skipped=tuple(pairs),
                       error=_text(d, "error", w), reason=_text(d, "reason", w)[:60],
                       worker=_text(d, "worker", w)[:128],
                       started=_num(d, "started", w, 0.0, 1e12), updated=_num(d, "updated", w, 0.0, 1e12),
                       version=_int(d, "version", w, 0, 1 << 31) if "version" in d else 0,
                       version_state=cast(VersionOutcome, version_state),
                       version_note=_text(d, "version_note", w))
        except ProtocolError:
            raise
        except Exception as exc:  # RecursionError, OverflowError...: whatever the value, one error type
            raise ProtocolError(f"build state: undecodable: {type(exc).__name__}: {exc}") from exc


# -- rules ---------------------------------------------------------------------------------------------------------

def transition_ok(old: BuildState | None, new: BuildState) -> bool:
    """Whether the store may write ``new`` over ``old`` (None: no state yet, the build is queued): a claim starts it
    ``running`` (or ``failed``: refused before it ran); a running build moves on; a finished one never changes; the
    tenant and the id never change."""
    if old is None:
        return new.state in ("running", "failed")
    if old.terminal or (old.build_id, old.tenant) != (new.build_id, new.tenant):
        return False
    return new.state in ("running", "done", "failed")


def claimable(old: BuildState | None, now: float, stale_s: float) -> bool:
    """Whether a store may claim the build: queued, or running but untouched for ``stale_s`` (its store died)."""
    if old is None:
        return True
    return old.state == "running" and now - old.updated > stale_s


def build_status(req: BuildRequest, st: BuildState | None) -> dict[str, Any]:
    """What the tenant sees of a build (the edge's ``GET .../builds/{id}``)."""
    out: dict[str, Any] = {"id": req.build_id, "task": req.task, "family": req.family, "state": "queued",
                           "stage": "", "progress": 0.0, "variants": [], "skipped": [], "error": "", "reason": "",
                           "created": req.created, "updated": req.created, "rows": req.rows,
                           "model_digest": req.model_digest, "validation_digest": req.validation_digest,
                           "min_accuracy": req.min_accuracy, "version": None, "version_state": "",
                           "version_note": ""}
    if st is not None:
        j = st.to_json()
        out.update({k: j[k] for k in ("state", "stage", "progress", "variants", "skipped", "error", "reason",
                                      "updated", "version_state", "version_note")})
        out["version"] = st.version or None
    return out


# -- validation sets -----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ValidationSummary:
    rows: int
    x_shape: tuple[int, ...]
    x_dtype: str


def scan_validation(path: Path, max_array_bytes: int) -> ValidationSummary:
    """Check an uploaded validation NPZ without trusting it: a zip holding ``x.npy`` (numbers, one row per example)
    and ``y.npy`` (integer labels, one per row), nothing pickled, each array at most ``max_array_bytes`` once
    decompressed (read from the ``.npy`` header before any data, so a zip bomb costs nothing). ``RequestError``
    naming what is wrong."""
    import numpy as np
    from numpy.lib import format as npy

    def bad(why: str) -> RequestError:
        return RequestError(f"the validation set is not a usable NPZ: {why}")

    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            if not {"x.npy", "y.npy"} <= names:
                raise bad(f"it needs arrays x and y, it holds {sorted(n.removesuffix('.npy') for n in names)[:8]}")
            shapes = {}
            for name in ("x", "y"):
                with zf.open(f"{name}.npy") as f:
                    version = npy.read_magic(f)
                    read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
                    shape, _, dtype = read(f, max_header_size=10_000)
                if dtype.hasobject or dtype.kind not in _TEXT_DTYPES:
                    raise bad(f"{name} has dtype {dtype}, not numbers")
                size = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
                if size > max_array_bytes:
                    raise bad(f"{name} holds {size} bytes, over the limit of {max_array_bytes}")
                shapes[name] = (tuple(int(s) for s in shape), dtype)
        (xs, xd), (ys, yd) = shapes["x"], shapes["y"]
        if len(xs) < 2 or len(ys) != 1 or xs[0] != ys[0]:
            raise bad(f"x {xs} and y {ys} must have one label per row (x at least 2-D)")
        if yd.kind not in "iu":
            raise bad(f"y has dtype {yd}, not integer labels")
        if xs[0] < 2:
            raise bad(f"{xs[0]} rows: at least 2 are needed (some calibrate, the rest are scored)")
        with np.load(path, allow_pickle=False) as z:  # the bounded read: both arrays must decode whole
            x, y = z["x"], z["y"]
        if x.shape != xs or y.shape != ys:
            raise bad("the arrays differ from their headers")
        return ValidationSummary(rows=xs[0], x_shape=xs, x_dtype=str(xd))
    except RequestError:
        raise
    except Exception as exc:  # BadZipFile, ValueError, OSError, EOFError, zlib.error...: the upload is unusable
        raise bad(f"{type(exc).__name__}: {str(exc)[:200]}") from exc
