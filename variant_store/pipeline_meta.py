"""A pipeline: the catalog's entry for a task declared as a graph of other tasks (issue 33, item 2). Etcd
``pipelines/<task>`` (``mesh.etcd.keys.pipeline_key``), JSON, schema 1.

Two shapes, as KServe's InferenceGraph names them:

* ``sequence``: ``stages`` run in order; stage ``i``'s inputs are fed, by name, from the pipeline's inputs
  (``input.<name>``) or from stage ``i - 1``'s outputs (``prev.<name>``). The pipeline answers with the last stage's
  outputs.
* ``switch``: ``stages`` holds one stage, the *selector*; each row's argmax of its output ``select`` picks, through
  ``table`` (class -> task), the branch that answers that row. ``branches`` says how each branch task is fed
  (``input.<name>`` or ``prev.<name>``, prev being the selector). Every branch answers with the same outputs, which
  are the pipeline's.

A stage names a *task*, never a variant: each stage is served as an ordinary query of its task, so the mesh picks
its variant and site as for any query (``edge_agent.pipeline_exec``). The entry also holds the pipeline's
``signature`` (derived from its stages' when it was registered, :mod:`variant_store.pipeline_catalog`), and what
was measured end to end on a held-out split: ``accuracy`` (None until measured), the rows it was measured on, and
``stage_accuracy`` (each stage task's accuracy floor at measurement: the stage queries ask for it, so a measured
pipeline is served by variants at least as accurate as those it was measured with).

:meth:`PipelineMeta.from_json` reads an entry as hostile input: ``ValueError`` for anything malformed, only that.

How rows run through the graph, in one place for the door that serves a pipeline (``edge_agent.pipeline_exec``) and
the store that measures one (:mod:`variant_store.pipeline_measure`): :func:`feed` (a stage's inputs by name) and
:func:`switch_rows` (which rows each branch of a Switch answers), pure, ``MeshError`` for what cannot run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from mesh.errors import MeshError
from mesh.types import TaskSignature
from variant_store.catalog import signature_from_json, signature_to_json
from variant_store.meta import PUBLIC

__all__ = ["KINDS", "MAX_BRANCHES", "MAX_STAGES", "SCHEMA_VERSION", "Kind", "PipelineMeta", "Stage", "feed", "source",
           "switch_rows"]

SCHEMA_VERSION = 1
Kind = Literal["sequence", "switch"]
KINDS: tuple[str, ...] = get_args(Kind)
MAX_STAGES = 8
MAX_BRANCHES = 64
MAX_FEEDS = 32
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TENSOR = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:/-]{0,127}")


def source(ref: str) -> tuple[Literal["input", "prev"], str]:
    """A feed's source: ``input.<name>`` (the pipeline's input) or ``prev.<name>`` (the previous stage's, or the
    selector's, output); ``ValueError`` otherwise."""
    if not isinstance(ref, str):
        raise ValueError("a feed's source is a string: input.<name> or prev.<name>")
    where, _, name = ref.partition(".")
    if where not in ("input", "prev") or not _TENSOR.fullmatch(name):
        raise ValueError(f"a feed's source is input.<name> or prev.<name>, not {ref[:80]!r}")
    return where, name  # type: ignore[return-value]  # checked just above


def feed(stage: Stage, inputs: Mapping[str, np.ndarray], prev: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The stage's inputs, by name, from the pipeline's ``inputs`` and the previous stage's outputs ``prev``."""
    out: dict[str, np.ndarray] = {}
    for name, ref in stage.feeds:
        where, src = source(ref)
        got = (inputs if where == "input" else prev).get(src)
        if got is None:
            raise MeshError(f"no {ref} to feed input {name!r} of stage {stage.task!r}")
        out[name] = got
    return out


def switch_rows(meta: PipelineMeta, scores: np.ndarray | None, n: int) -> dict[str, np.ndarray]:
    """The rows each branch of the Switch ``meta`` answers, from its selector's ``select`` output ``scores`` for
    the ``n`` rows (None: the selector gave none): each row's argmax through the table. Branch task -> its row
    indices (ascending), branches in the order of their first row. ``MeshError`` when ``scores`` is not
    (n, classes) or a row picks a class the table does not map."""
    if scores is None or scores.ndim != 2 or scores.shape[0] != n:
        got = "nothing" if scores is None else f"{list(scores.shape)}"
        raise MeshError(f"its output {meta.select!r} is {got}, not ({n}, classes)")
    picked = np.argmax(scores, axis=1)
    table = dict(meta.table)
    unmapped = sorted({int(c) for c in picked} - set(table))
    if unmapped:
        raise MeshError(f"it picked class(es) {unmapped[:10]}, which the switch's table does not map")
    by_task: dict[str, list[int]] = {}
    for row, c in enumerate(picked.tolist()):
        by_task.setdefault(table[c], []).append(row)
    return {task: np.asarray(rows, dtype=np.int64) for task, rows in by_task.items()}


@dataclass(frozen=True, slots=True)
class Stage:
    """A task run as one step of a pipeline, its inputs fed by name: (its input name, source) pairs."""

    task: str
    feeds: tuple[tuple[str, str], ...]

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "feeds": dict(self.feeds)}

    @classmethod
    def from_json(cls, data: Any) -> Stage:
        if not isinstance(data, dict) or not isinstance(data.get("feeds"), dict):
            raise ValueError("a stage is an object with a task and its feeds ({input: source})")
        stage = cls(task=data.get("task"), feeds=tuple(sorted(data["feeds"].items())))  # type: ignore[arg-type]
        _check_stage(stage)
        return stage


@dataclass(frozen=True, slots=True)
class PipelineMeta:
    task: str
    kind: Kind
    stages: tuple[Stage, ...]                 # sequence: in order; switch: the selector alone
    signature: TaskSignature                  # the pipeline's inputs and outputs, derived at registration
    select: str = ""                          # switch: the selector's output whose argmax picks the branch
    table: tuple[tuple[int, str], ...] = ()   # switch: class -> branch task
    branches: tuple[Stage, ...] = ()          # switch: how each branch task of the table is fed
    accuracy: float | None = None             # measured end to end on held-out rows; None: not measured
    heldout_rows: int = 0
    stage_accuracy: tuple[tuple[str, float], ...] = ()  # stage task -> the accuracy floor it was measured at
    owner: str = PUBLIC
    created: float = 0.0
    schema: int = field(default=SCHEMA_VERSION)

    def __post_init__(self) -> None:
        _check(self)

    def tasks(self) -> tuple[str, ...]:
        """Every task the pipeline runs (selector and branches), each once, in order."""
        names = [s.task for s in self.stages] + [b.task for b in self.branches]
        return tuple(dict.fromkeys(names))

    def branch(self, task: str) -> Stage:
        return next(b for b in self.branches if b.task == task)

    def floor(self, task: str) -> float:
        """The accuracy a stage query of ``task`` asks for (0 when the pipeline was not measured)."""
        return dict(self.stage_accuracy).get(task, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"schema": self.schema, "task": self.task, "kind": self.kind,
                "stages": [s.to_json() for s in self.stages], "signature": signature_to_json(self.signature),
                "select": self.select, "table": {str(c): t for c, t in self.table},
                "branches": [b.to_json() for b in self.branches], "accuracy": self.accuracy,
                "heldout_rows": self.heldout_rows, "stage_accuracy": dict(self.stage_accuracy),
                "owner": self.owner, "created": self.created}

    @classmethod
    def from_json(cls, data: Any) -> PipelineMeta:
        if not isinstance(data, dict):
            raise ValueError(f"a pipeline entry must be an object, not a {type(data).__name__}")
        try:
            table, floors = data.get("table", {}), data.get("stage_accuracy", {})
            if not isinstance(table, dict) or not isinstance(floors, dict):
                raise ValueError("table and stage_accuracy are objects")
            return cls(task=data["task"], kind=data["kind"], stages=_stages(data["stages"], "stages"),
                       signature=signature_from_json(data["signature"]), select=data.get("select", ""),
                       table=tuple(sorted((_class(c), t) for c, t in table.items())),
                       branches=_stages(data.get("branches", []), "branches"), accuracy=data.get("accuracy"),
                       heldout_rows=data.get("heldout_rows", 0), stage_accuracy=tuple(sorted(floors.items())),
                       owner=data.get("owner", PUBLIC), created=data.get("created", 0.0),
                       schema=data.get("schema", SCHEMA_VERSION))
        except KeyError as exc:
            raise ValueError(f"a pipeline entry needs {exc.args[0]!r}") from exc


def _class(value: Any) -> int:
    if not isinstance(value, str) or not value.isdigit() or len(value) > 6:
        raise ValueError(f"a switch table's keys are class numbers, not {str(value)[:40]!r}")
    return int(value)


def _stages(value: Any, name: str) -> tuple[Stage, ...]:
    if not isinstance(value, list) or len(value) > MAX_BRANCHES:
        raise ValueError(f"{name} must be a list of at most {MAX_BRANCHES} stages")
    return tuple(Stage.from_json(v) for v in value)


def _check_stage(s: Stage) -> None:
    if not isinstance(s.task, str) or not _NAME.fullmatch(s.task):
        raise ValueError("a stage's task must be a name of letters, digits, '.', '_', '-' (at most 128)")
    if not 1 <= len(s.feeds) <= MAX_FEEDS:
        raise ValueError(f"stage {s.task!r} needs 1..{MAX_FEEDS} feeds")
    for name, ref in s.feeds:
        if not isinstance(name, str) or not _TENSOR.fullmatch(name):
            raise ValueError(f"stage {s.task!r}: an input name must be a tensor name, not {str(name)[:80]!r}")
        source(ref)


def _check(m: PipelineMeta) -> None:
    for name, value in (("task", m.task), ("owner", m.owner)):
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise ValueError(f"{name} must be a name of letters, digits, '.', '_', '-' (at most 128)")
    if m.kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    if not isinstance(m.signature, TaskSignature) or m.signature.task != m.task:
        raise ValueError("a pipeline's signature is its own task's")
    for s in (*m.stages, *m.branches):
        _check_stage(s)
    if m.kind == "sequence":
        if not 1 <= len(m.stages) <= MAX_STAGES:
            raise ValueError(f"a sequence has 1..{MAX_STAGES} stages")
        if m.select or m.table or m.branches:
            raise ValueError("a sequence has no select, table or branches")
        if any(ref.startswith("prev.") for _, ref in m.stages[0].feeds):
            raise ValueError("the first stage has no previous stage to be fed from")
    else:
        if len(m.stages) != 1:
            raise ValueError("a switch has one selector stage")
        if not isinstance(m.select, str) or not _TENSOR.fullmatch(m.select):
            raise ValueError("a switch names the selector's output it selects on (select)")
        if any(ref.startswith("prev.") for _, ref in m.stages[0].feeds):
            raise ValueError("the selector is fed from the pipeline's inputs only")
        if not 1 <= len(m.table) <= MAX_BRANCHES:
            raise ValueError(f"a switch's table maps 1..{MAX_BRANCHES} classes to tasks")
        if any(not isinstance(t, str) or not _NAME.fullmatch(t) for _, t in m.table):
            raise ValueError("a switch's table maps classes to task names")
        named = [b.task for b in m.branches]
        if len(set(named)) != len(named) or set(named) != {t for _, t in m.table}:
            raise ValueError("a switch describes each task of its table once in branches, and no other")
    if m.accuracy is not None:
        _fraction(m.accuracy, "accuracy")
    if isinstance(m.heldout_rows, bool) or not isinstance(m.heldout_rows, int) or not 0 <= m.heldout_rows <= 2**40:
        raise ValueError("heldout_rows must be a count")
    if m.accuracy is not None and m.heldout_rows < 1:
        raise ValueError("a measured accuracy says how many held-out rows it was measured on")
    for t, a in m.stage_accuracy:
        if not isinstance(t, str) or t not in m.tasks():
            raise ValueError(f"stage_accuracy names {str(t)[:80]!r}, not a stage's task")
        _fraction(a, f"stage_accuracy[{t}]")
    if isinstance(m.created, bool) or not isinstance(m.created, int | float) or not math.isfinite(m.created) \
            or m.created < 0:
        raise ValueError("created must be a time in epoch seconds")
    if m.schema != SCHEMA_VERSION:
        raise ValueError(f"pipeline schema {m.schema!r} is not {SCHEMA_VERSION}")


def _fraction(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1]")
