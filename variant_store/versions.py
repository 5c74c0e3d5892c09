"""Versions of a tenant's task (issue 34 item 3): records and the pure rules over them.

Each registration of a tenant's task is a version (1, 2, ...). ``versions/<task>`` (the store's alone to write:
``mesh.etcd.rbac``) holds a :class:`VersionRecord`: every version's family, best measured accuracy and state, the
*active* version, the traffic split when the tenant set one, and the task's accuracy bar when the tenant declared one
(``min_accuracy`` on a registration; the latest declaration wins, a registration without one keeps it). Routing does
not follow that key: the store mirrors each version's traffic share into its variants' catalog entries
(``VariantMeta.share``, with ``VariantMeta.version``), which every agent's view already follows, so the router's
version filter (``core_scheduler.policy.versions``) needs no other watch and sees a move the moment the catalog does.

Lifecycle of version N+1 while N is active (the I/O is :mod:`variant_store.version_keeper`)::

    building   N+1's variants are catalogued with share 0: traffic stays on N (share 1 for a first version, unless a
               bar is declared: then it waits, as any version, to meet it)
    active     once built, when one of its variants meets the task's accuracy (:func:`required_accuracy`: the declared
               bar, else the best of N; a first version with no bar declared always): its variants' shares go to 1
               first, then N's to 0, so a router never sees a task without a version to serve; N becomes ``retiring``
    held       built but below the accuracy: catalogued with share 0 (a tenant may still split traffic to it); N, if
               any, stays active. ``note`` says why (``best 0.91 < declared 0.95``), as the build's state does. A
               held first version leaves the task with no active version and no traffic: routing refuses its queries
               ``no_route`` unless they pin a version (``core_scheduler.policy.versions.pick_version``)
    failed     the build failed: its variants are removed, N stays active
    retiring   removed from the catalog ``grace_s`` after the move (a fixed grace, not in-flight counts: a query
               routed to N before the move finishes within its SLO, at most ``mesh.types.MAX_LATENCY_MS``, so the
               grace is longer than any query lives); never while a split names it
    retired    its variants and registration are gone

A door asks the store to split a task's traffic or delete it through ``modelops/<tenant>/<id>``
(:class:`ModelOp`): a door may not write the catalog, and the store checks the tenant owns the task.
Every decoder here reads etcd, where anything may have been written: ``ValueError`` for anything malformed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast, get_args

__all__ = ["MAX_VERSIONS", "ModelOp", "VersionInfo", "VersionRecord", "VersionState", "due_retirements",
           "move_verdict", "next_version", "normalise_weights", "required_accuracy", "shares_of"]

VersionState = Literal["building", "active", "held", "failed", "retiring", "retired"]
OpKind = Literal["traffic", "delete"]
MAX_VERSIONS = 10_000
_MAX_NOTE = 256
_ACCURACY_SLACK = 1e-9  # a best equal to the bar up to float rounding meets it
_SERVABLE = ("active", "held", "retiring")  # catalogued: a split may name them


def _int(value: Any, name: str, lo: int = 0, hi: int = 2**31) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}]")
    return value


def _float(value: Any, name: str, hi: float = 1.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= hi:
        raise ValueError(f"{name} must be a number in [0, {hi:g}]")
    return float(value)


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise ValueError(f"{name} must be a non-empty string of at most 256 characters")
    return value


def _note(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("a version's note must be a string")
    return value[:_MAX_NOTE]


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, not a {type(value).__name__}")
    return value


def _version_key(key: Any) -> int:
    if not isinstance(key, str) or not key.isascii() or not key.isdigit() or len(key) > 6:
        raise ValueError(f"a version is a positive integer, not {str(key)[:20]!r}")
    return _int(int(key), "version", 1, MAX_VERSIONS)


def _weights(value: Any) -> dict[int, float]:
    return {_version_key(k): _float(w, "weight") for k, w in _object(value, "weights").items()}


@dataclass(frozen=True, slots=True)
class VersionInfo:
    family: str
    state: VersionState
    accuracy: float = 0.0      # the best of its variants' measured accuracies (0 until built)
    retire_at: float = 0.0     # when a retiring version is removed (unix seconds)
    note: str = ""             # why it became active or held, once built (e.g. "best 0.91 < declared 0.95")

    def to_json(self) -> dict[str, Any]:
        out = {"family": self.family, "state": self.state, "accuracy": self.accuracy, "retire_at": self.retire_at}
        return {**out, "note": self.note} if self.note else out

    @classmethod
    def from_json(cls, data: Any) -> VersionInfo:
        d = _object(data, "version")
        state = d.get("state")
        if state not in get_args(VersionState):
            raise ValueError(f"a version's state is one of {get_args(VersionState)}")
        return cls(family=_str(d.get("family"), "family"), state=cast(VersionState, state),
                   accuracy=_float(d.get("accuracy", 0.0), "accuracy"),
                   retire_at=_float(d.get("retire_at", 0.0), "retire_at", 1e12),
                   note=_note(d.get("note", "")))


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """``versions/<task>``: a tenant task's versions, the active one (0: none yet), the split (empty: none) and the
    accuracy bar the tenant declared (None: none; a record written before the field decodes so)."""

    task: str
    owner: str
    active: int = 0
    versions: Mapping[int, VersionInfo] = field(default_factory=dict)
    weights: Mapping[int, float] = field(default_factory=dict)
    min_accuracy: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"task": self.task, "owner": self.owner, "active": self.active,
               "versions": {str(v): i.to_json() for v, i in sorted(self.versions.items())},
               "weights": {str(v): w for v, w in sorted(self.weights.items())}}
        return out if self.min_accuracy is None else {**out, "min_accuracy": self.min_accuracy}

    @classmethod
    def from_json(cls, data: Any) -> VersionRecord:
        d = _object(data, "version record")
        versions = {_version_key(k): VersionInfo.from_json(v) for k, v in _object(d.get("versions", {}),
                                                                                   "versions").items()}
        if len(versions) > MAX_VERSIONS:
            raise ValueError("too many versions")
        active = _int(d.get("active", 0), "active", 0, MAX_VERSIONS)
        if active and active not in versions:
            raise ValueError(f"the active version {active} is not among the versions")
        bar = d.get("min_accuracy")
        return cls(task=_str(d.get("task"), "task"), owner=_str(d.get("owner"), "owner"), active=active,
                   versions=versions, weights=_weights(d.get("weights", {})),
                   min_accuracy=None if bar is None else _float(bar, "min_accuracy"))

    def but(self, **changes: Any) -> VersionRecord:
        return replace(self, **changes)

    def with_version(self, version: int, info: VersionInfo) -> VersionRecord:
        return replace(self, versions={**self.versions, version: info})

    def to_summary(self) -> dict[str, Any]:
        """What a tenant sees (``GET /v2/models/{task}/versions``)."""
        shares = shares_of(self)
        return {"task": self.task, "active": self.active or None, "min_accuracy": self.min_accuracy,
                "traffic": {str(v): w for v, w in sorted(shares.items())},
                "versions": [{"version": v, "family": i.family, "state": i.state, "accuracy": i.accuracy,
                              "share": shares.get(v, 0.0),
                              **({"retire_at": i.retire_at} if i.state == "retiring" else {}),
                              **({"note": i.note} if i.note else {})}
                             for v, i in sorted(self.versions.items())]}


@dataclass(frozen=True, slots=True)
class ModelOp:
    """``modelops/<tenant>/<id>``: a door's request (``state`` None) and then the store's answer."""

    op_id: str
    tenant: str
    task: str
    op: OpKind
    weights: Mapping[int, float] = field(default_factory=dict)
    created: float = 0.0
    state: Literal["done", "failed"] | None = None
    reason: str = ""       # failed: "not_found" (404), "bad_request" (400), "conflict" (409)
    error: str = ""
    result: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.op_id, "tenant": self.tenant, "task": self.task, "op": self.op,
                "weights": {str(v): w for v, w in self.weights.items()}, "created": self.created,
                "state": self.state, "reason": self.reason, "error": self.error, "result": dict(self.result)}

    @classmethod
    def from_json(cls, data: Any) -> ModelOp:
        d = _object(data, "model op")
        op = d.get("op")
        if op not in get_args(OpKind):
            raise ValueError(f"a model op is one of {get_args(OpKind)}")
        state = d.get("state")
        if state not in (None, "done", "failed"):
            raise ValueError("a model op's state is done, failed or absent")
        result = _object(d.get("result") or {}, "result")
        return cls(op_id=_str(d.get("id"), "id"), tenant=_str(d.get("tenant"), "tenant"),
                   task=_str(d.get("task"), "task"), op=cast(OpKind, op), weights=_weights(d.get("weights", {})),
                   created=_float(d.get("created", 0.0), "created", 1e12), state=state,
                   reason=str(d.get("reason", ""))[:64], error=str(d.get("error", ""))[:2000], result=result)


# -- the pure rules ---------------------------------------------------------------------------------------------
def next_version(record: VersionRecord | None) -> int:
    """The number the next registration of the task gets: one past every version it ever had."""
    return max(record.versions, default=0) + 1 if record is not None else 1


def required_accuracy(record: VersionRecord | None) -> float:
    """What a new version must reach for traffic to move to it: the bar the tenant declared when it declared one,
    else the active version's best accuracy (0: none active)."""
    if record is None:
        return 0.0
    if record.min_accuracy is not None:
        return record.min_accuracy
    if not record.active:
        return 0.0
    return record.versions[record.active].accuracy


def move_verdict(record: VersionRecord, version: int, best: float) -> tuple[bool, str]:
    """Whether traffic moves to ``version`` of ``record`` now built with ``best`` accuracy, and why (the words a
    tenant reads in the version's ``note`` and its build's state): with a declared bar, when ``best`` meets it (a
    first version too); without one, a first version always, a later one when ``best`` meets the active one's."""
    bar = required_accuracy(record)
    if record.min_accuracy is not None:
        what = "declared"
    elif record.active and record.active != version:
        what = f"version {record.active}'s"
    else:
        return True, f"best {best:.4g}: the task's first version"
    if best >= bar - _ACCURACY_SLACK:
        return True, f"best {best:.4g} >= {what} {bar:.4g}"
    return False, f"best {best:.4g} < {what} {bar:.4g}"


def shares_of(record: VersionRecord) -> dict[int, float]:
    """Each version's share of the task's traffic: the split when one is set, else all of it to the active one."""
    if record.weights:
        return dict(record.weights)
    return {record.active: 1.0} if record.active else {}


def normalise_weights(record: VersionRecord, asked: Mapping[int, float]) -> dict[int, float]:
    """A split as the tenant asked it, checked against the record and scaled to sum 1; ``ValueError`` naming the
    problem: an unknown or unservable version, a weight that is no finite number >= 0, or none above 0."""
    if not asked:
        raise ValueError("a traffic split names one version at least, e.g. {\"2\": 0.1, \"1\": 0.9}")
    for v, w in asked.items():
        info = record.versions.get(v)
        if info is None or info.state not in _SERVABLE:
            have = sorted(x for x, i in record.versions.items() if i.state in _SERVABLE)
            raise ValueError(f"task {record.task!r} has no servable version {v} (servable: {have})")
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"the weight of version {v} must be a finite number >= 0, not {w!r}")
    total = sum(asked.values())
    if total <= 0:
        raise ValueError("a traffic split gives some version a weight above 0")
    return {v: w / total for v, w in sorted(asked.items()) if w > 0}


def due_retirements(record: VersionRecord, now: float) -> list[int]:
    """Retiring versions whose grace is over and that no split names (a canary waits for its split to end)."""
    split = {v for v, w in record.weights.items() if w > 0}
    return sorted(v for v, i in record.versions.items()
                  if i.state == "retiring" and i.retire_at <= now and v not in split and v != record.active)


def servable(record: VersionRecord) -> Iterable[int]:
    return (v for v, i in record.versions.items() if i.state in _SERVABLE)
