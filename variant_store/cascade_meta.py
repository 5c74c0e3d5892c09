"""A cascade: the catalog's entry for a task answered by a small variant when it is sure, by a larger one when not
(issue 33). Etcd ``cascades/<task>/<cascade_id>`` (``mesh.etcd.keys.cascade_key``), JSON, schema 1.

A cascade lists two or more of the task's variants as stages, smallest first. Stage ``i`` (all but the last)
answers a row when its confidence (:func:`confidence` under ``rule``) is at least ``thresholds[i]``; otherwise the
row escalates to stage ``i + 1``; the last stage always answers. The thresholds are *calibrated* by the variant
store on one half of the task's validation split so that the cascade meets ``target_accuracy``, and the figures
the router believes are *measured* on the other half: ``accuracy`` (the cascade's top-1 on the held-out rows) and
``escalation`` (the share of held-out rows that reached stage ``i + 1``, for each ``i``). Like a variant's
accuracy, they are never copied from anything.

:meth:`CascadeMeta.from_json` reads an entry as hostile input (anything may have been written to etcd): every field
checked for type and range, ``ValueError`` for anything malformed, only that.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from variant_store.meta import PUBLIC

__all__ = ["RULES", "SCHEMA_VERSION", "CascadeMeta", "Rule", "confidence"]

SCHEMA_VERSION = 1
Rule = Literal["max_softmax", "margin"]
RULES: tuple[str, ...] = get_args(Rule)
MAX_STAGES = 4
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def confidence(rule: Rule, logits: np.ndarray) -> np.ndarray:
    """Each row's confidence in its own top-1 answer, from a stage's output ``logits`` (N, C): the largest softmax
    probability (``max_softmax``) or the gap between the two largest (``margin``), in [0, 1]. Computed stably
    (max-shifted); a row of non-finite logits has confidence 0 (it always escalates)."""
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] < 2:
        raise ValueError(f"a cascade stage's output must be (rows, classes >= 2), not {x.shape}")
    finite: np.ndarray = np.asarray(np.isfinite(x).all(axis=1))
    x = np.where(finite[:, None], x, 0.0)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    if rule == "max_softmax":
        conf = p.max(axis=1)
    elif rule == "margin":
        top2 = np.sort(p, axis=1)[:, -2:]
        conf = top2[:, 1] - top2[:, 0]
    else:
        raise ValueError(f"unknown cascade rule {rule!r}: one of {RULES}")
    return np.where(finite, conf, 0.0)


@dataclass(frozen=True, slots=True)
class CascadeMeta:
    task: str
    cascade_id: str                      # unique within the task, e.g. "cascade-mlp-tiny-int8-mlp-wide"
    stages: tuple[str, ...]              # variant ids of the task, cheapest first (2..MAX_STAGES)
    rule: Rule
    thresholds: tuple[float, ...]        # one per stage but the last, in [0, 1]
    accuracy: float                      # measured on the held-out half of the validation split
    escalation: tuple[float, ...]        # share of held-out rows reaching stage i + 1, one per threshold
    target_accuracy: float               # what the calibration was asked to meet
    calibration_rows: int
    heldout_rows: int
    owner: str = PUBLIC                  # PUBLIC or the tenant whose variants it chains
    created: float = 0.0
    schema: int = field(default=SCHEMA_VERSION)

    def __post_init__(self) -> None:
        _check(self)

    def to_json(self) -> dict[str, Any]:
        return {"schema": self.schema, "task": self.task, "cascade_id": self.cascade_id, "stages": list(self.stages),
                "rule": self.rule, "thresholds": list(self.thresholds), "accuracy": self.accuracy,
                "escalation": list(self.escalation), "target_accuracy": self.target_accuracy,
                "calibration_rows": self.calibration_rows, "heldout_rows": self.heldout_rows, "owner": self.owner,
                "created": self.created}

    @classmethod
    def from_json(cls, data: Any) -> CascadeMeta:
        if not isinstance(data, dict):
            raise ValueError(f"a cascade entry must be an object, not a {type(data).__name__}")
        try:
            return cls(task=data["task"], cascade_id=data["cascade_id"], stages=_tuple(data["stages"], "stages"),
                       rule=data["rule"], thresholds=_tuple(data["thresholds"], "thresholds"),
                       accuracy=data["accuracy"], escalation=_tuple(data["escalation"], "escalation"),
                       target_accuracy=data["target_accuracy"], calibration_rows=data["calibration_rows"],
                       heldout_rows=data["heldout_rows"], owner=data.get("owner", PUBLIC),
                       created=data.get("created", 0.0), schema=data.get("schema", SCHEMA_VERSION))
        except KeyError as exc:
            raise ValueError(f"a cascade entry needs {exc.args[0]!r}") from exc


def _tuple(value: Any, name: str) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list")
    return tuple(value)


def _fraction(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1]")


def _check(m: CascadeMeta) -> None:
    for name, value in (("task", m.task), ("cascade_id", m.cascade_id), ("owner", m.owner)):
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise ValueError(f"{name} must be a name of letters, digits, '.', '_', '-' (at most 128)")
    if not 2 <= len(m.stages) <= MAX_STAGES or not all(isinstance(s, str) and _NAME.fullmatch(s) for s in m.stages):
        raise ValueError(f"stages must be 2..{MAX_STAGES} variant ids")
    if len(set(m.stages)) != len(m.stages):
        raise ValueError("a cascade names each variant once")
    if m.rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}")
    if len(m.thresholds) != len(m.stages) - 1 or len(m.escalation) != len(m.stages) - 1:
        raise ValueError("a cascade has one threshold and one escalation rate per stage but the last")
    for i, t in enumerate(m.thresholds):
        _fraction(t, f"thresholds[{i}]")
    for i, e in enumerate(m.escalation):
        _fraction(e, f"escalation[{i}]")
    if any(b > a + 1e-12 for a, b in zip(m.escalation, m.escalation[1:], strict=False)):
        raise ValueError("escalation rates cannot grow along the cascade (a row reaching stage 3 reached stage 2)")
    _fraction(m.accuracy, "accuracy")
    _fraction(m.target_accuracy, "target_accuracy")
    for name, n in (("calibration_rows", m.calibration_rows), ("heldout_rows", m.heldout_rows)):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 2**40:
            raise ValueError(f"{name} must be a positive count")
    if isinstance(m.created, bool) or not isinstance(m.created, int | float) or not math.isfinite(m.created) \
            or m.created < 0:
        raise ValueError("created must be a time in epoch seconds")
    if m.schema != SCHEMA_VERSION:
        raise ValueError(f"cascade schema {m.schema!r} is not {SCHEMA_VERSION}")
