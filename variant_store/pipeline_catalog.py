"""Pipelines in etcd (``pipelines/<task>``, :mod:`variant_store.pipeline_meta`): reading a graph as an operator
writes it, checking it against the catalog's task signatures, and decoding, reading, writing and removing entries.
The mesh's view decodes with :func:`decode_pipeline` too, so an entry means the same to the CLI and the door.

:func:`plan_graph` is the check, a pure function over the signatures: it refuses (``PipelineRefused``, nothing
written) a stage naming no catalogued task (``unknown_task``), a stage that is the pipeline itself, directly or
through other pipelines (``cycle``), an input fed by nothing or by an output of another name, dtype or shape
(``signature``), a Switch whose selector output is not (rows, classes) or whose table names classes it cannot
give, or whose branches answer differently (``table`` / ``signature``). It returns the pipeline's signature: its
inputs are those the stages take from ``input.<name>``, its outputs the last stage's (or every branch's).

Feeds may be left out in a graph: a stage's input ``x`` is then fed from ``prev.x`` when the previous stage (or the
selector) has an output ``x``, else from ``input.x``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mesh.errors import CatalogError, PipelineRefused
from mesh.etcd.keys import CATALOG, PIPELINES, TASK_NAME, pipeline_key
from mesh.etcd.store import Store
from mesh.types import TaskSignature, TensorSpec
from variant_store.catalog import signature_from_json
from variant_store.catalog_check import BrokenEntry
from variant_store.meta import PUBLIC
from variant_store.pipeline_meta import MAX_BRANCHES, MAX_STAGES, PipelineMeta, Stage, source

__all__ = ["Graph", "PipelineReading", "decode_pipeline", "get_pipeline", "graph_from_yaml", "plan_graph",
           "read_pipelines", "read_signatures", "register_pipeline", "remove_pipeline"]


@dataclass(frozen=True, slots=True)
class Graph:
    """A graph as an operator declares it, feeds possibly left out (``None``: by name, see the module)."""

    kind: str
    stages: tuple[tuple[str, dict[str, str] | None], ...]      # (task, feeds); switch: the selector alone
    select: str = ""
    table: tuple[tuple[int, str], ...] = ()
    branches: tuple[tuple[str, dict[str, str] | None], ...] = ()


@dataclass(slots=True)
class PipelineReading:
    pipelines: list[PipelineMeta] = field(default_factory=list)
    broken: list[BrokenEntry] = field(default_factory=list)


def _refuse(msg: str, reason: str, task: str) -> PipelineRefused:
    return PipelineRefused(msg, reason=reason, task=task)


def _stage_list(value: Any, what: str, task: str) -> tuple[tuple[str, dict[str, str] | None], ...]:
    if not isinstance(value, list) or not value or len(value) > MAX_BRANCHES:
        raise _refuse(f"{what} must be a list of 1..{MAX_BRANCHES} stages", "graph", task)
    out = []
    for v in value:
        if isinstance(v, str):
            v = {"task": v}
        if not isinstance(v, dict) or not isinstance(v.get("task"), str) or set(v) - {"task", "feeds"}:
            raise _refuse(f"a stage in {what} is a task name or {{task, feeds}}, not {str(v)[:80]!r}", "graph", task)
        feeds = v.get("feeds")
        if feeds is not None and (not isinstance(feeds, dict)
                                  or not all(isinstance(k, str) and isinstance(s, str) for k, s in feeds.items())):
            raise _refuse(f"stage {v['task']!r}: feeds map input names to input.<name> or prev.<name>", "graph",
                          task)
        out.append((v["task"], feeds))
    return tuple(out)


def graph_from_yaml(data: Any, task: str) -> Graph:
    """A graph from its YAML/JSON form (hostile: ``PipelineRefused`` reason ``graph`` for anything malformed)::

        kind: sequence                      kind: switch
        stages: [a, {task: b, feeds: {h: prev.y}}]   select: {task: g, output: logits}
                                            table: {0: head-a, 1: head-b}
                                            branches: [{task: head-a, feeds: {x: input.x}}]   # optional
    """
    if not isinstance(data, dict) or data.get("kind") not in ("sequence", "switch"):
        raise _refuse("a graph is a mapping with kind: sequence or kind: switch", "graph", task)
    if data["kind"] == "sequence":
        if set(data) - {"kind", "stages"}:
            raise _refuse(f"a sequence has kind and stages only, not {sorted(set(data) - {'kind', 'stages'})}",
                          "graph", task)
        stages = _stage_list(data.get("stages"), "stages", task)
        if len(stages) > MAX_STAGES:
            raise _refuse(f"a sequence has at most {MAX_STAGES} stages", "graph", task)
        return Graph("sequence", stages)
    if set(data) - {"kind", "select", "table", "branches"}:
        raise _refuse("a switch has kind, select, table and branches only", "graph", task)
    sel = data.get("select")
    if not isinstance(sel, dict) or not isinstance(sel.get("output"), str) or set(sel) - {"task", "feeds", "output"}:
        raise _refuse("a switch's select is {task, output[, feeds]}", "graph", task)
    table = data.get("table")
    if not isinstance(table, dict) or not table or len(table) > MAX_BRANCHES:
        raise _refuse(f"a switch's table maps 1..{MAX_BRANCHES} classes to tasks", "table", task)
    rows = []
    for c, t in table.items():
        if isinstance(c, bool) or not isinstance(c, int | str) or not str(c).isdigit() or len(str(c)) > 6 \
                or not isinstance(t, str):
            raise _refuse(f"a switch's table maps class numbers to task names, not {str(c)[:20]!r}: "
                          f"{str(t)[:40]!r}", "table", task)
        rows.append((int(c), t))
    if len({c for c, _ in rows}) != len(rows):
        raise _refuse("a switch's table names a class twice", "table", task)
    given = _stage_list(data["branches"], "branches", task) if data.get("branches") is not None else ()
    named = dict(given)
    extra = set(named) - {t for _, t in rows}
    if extra or len(named) != len(given):
        raise _refuse(f"branches describe tasks of the table, each once (not {sorted(extra)})", "table", task)
    branches = tuple((t, named.get(t)) for t in dict.fromkeys(t for _, t in sorted(rows)))
    selector = _stage_list([{k: v for k, v in sel.items() if k != "output"}], "select", task)
    return Graph("switch", selector, sel["output"], tuple(sorted(rows)), branches)


def _compatible(a: TensorSpec, b: TensorSpec) -> bool:
    """Whether a tensor of spec ``a`` may be fed where ``b`` is expected: same dtype and rank, each size equal
    or dynamic (-1) on one side."""
    return a.dtype == b.dtype and len(a.shape) == len(b.shape) and all(
        x == y or -1 in (x, y) for x, y in zip(a.shape, b.shape, strict=True))


def _fmt(s: TensorSpec) -> str:
    return f"{s.name} {s.dtype}{list(s.shape)}"


def plan_graph(task: str, graph: Graph, signatures: Mapping[str, TaskSignature],
               pipelines: Mapping[str, PipelineMeta]) -> tuple[tuple[Stage, ...], tuple[Stage, ...], TaskSignature]:
    """Check ``graph`` for the pipeline ``task`` against the catalog's ``signatures`` and the registered
    ``pipelines`` (a stage may be one); returns its stages and branches with every feed resolved, and its
    signature. ``PipelineRefused`` (see the module docstring) for a graph that cannot run."""
    if task in signatures:
        raise _refuse(f"task {task!r} has variants of its own: a pipeline takes a task name of its own", "name",
                      task)
    _no_cycle(task, graph, pipelines)

    def sig(t: str) -> TaskSignature:
        found = pipelines[t].signature if t in pipelines and t != task else signatures.get(t)
        if found is None:
            raise _refuse(f"stage task {t!r} is not catalogued (`tiermesh variants list`)", "unknown_task", task)
        return found

    inputs: dict[str, TensorSpec] = {}

    def resolve(t: str, feeds: dict[str, str] | None, prev: TaskSignature | None) -> Stage:
        s = sig(t)
        prev_out = {o.name: o for o in prev.outputs} if prev is not None else {}
        if feeds is None:
            feeds = {i.name: f"prev.{i.name}" if i.name in prev_out else f"input.{i.name}" for i in s.inputs}
        wanted = {i.name: i for i in s.inputs}
        unknown = sorted(set(feeds) - set(wanted))
        missing = sorted(set(wanted) - set(feeds))
        if unknown or missing:
            raise _refuse(f"stage {t!r} takes inputs {sorted(wanted)}: fed {sorted(feeds)}", "signature", task)
        for name, ref in sorted(feeds.items()):
            try:
                where, src = source(ref)
            except ValueError as exc:
                raise _refuse(f"stage {t!r} input {name!r}: {exc}", "graph", task) from exc
            want = wanted[name]
            if where == "prev":
                got = prev_out.get(src)
                if got is None:
                    raise _refuse(f"stage {t!r} input {name!r} is fed from prev.{src}, which the stage before "
                                  f"does not output (it outputs {sorted(prev_out) or 'nothing: it is first'})",
                                  "signature", task)
                if not _compatible(got, want):
                    raise _refuse(f"stage {t!r} input {_fmt(want)} cannot take the stage before's output "
                                  f"{_fmt(got)}", "signature", task)
            else:
                have = inputs.setdefault(src, TensorSpec(src, want.dtype, want.shape))
                if not _compatible(have, want):
                    raise _refuse(f"pipeline input {_fmt(have)} cannot feed stage {t!r} input {_fmt(want)}",
                                  "signature", task)
        return Stage(t, tuple(sorted(feeds.items())))

    stages: list[Stage] = []
    prev: TaskSignature | None = None
    for t, feeds in graph.stages:
        stages.append(resolve(t, feeds, prev))
        prev = sig(t)
    assert prev is not None
    if graph.kind == "sequence":
        return tuple(stages), (), TaskSignature(task, tuple(inputs.values()), prev.outputs, prev.metric)
    out = {o.name: o for o in prev.outputs}.get(graph.select)
    if out is None:
        raise _refuse(f"the selector {prev.task!r} has no output {graph.select!r} (it has "
                      f"{[o.name for o in prev.outputs]})", "signature", task)
    if len(out.shape) != 2 or not out.dtype.startswith("float"):
        raise _refuse(f"the selector's output {_fmt(out)} is not (rows, classes) of scores", "signature", task)
    classes = out.shape[1]
    if classes != -1 and any(c >= classes for c, _ in graph.table):
        raise _refuse(f"the table names class {max(c for c, _ in graph.table)}; the selector gives {classes}",
                      "table", task)
    branches = tuple(resolve(t, feeds, prev) for t, feeds in graph.branches)
    first = sig(branches[0].task)
    for b in branches[1:]:
        other = sig(b.task)
        if [(o.name, o.dtype, o.shape) for o in other.outputs] != [(o.name, o.dtype, o.shape) for o in first.outputs]:
            raise _refuse(f"branches answer differently: {branches[0].task!r} {[_fmt(o) for o in first.outputs]}, "
                          f"{b.task!r} {[_fmt(o) for o in other.outputs]}", "signature", task)
    return tuple(stages), branches, TaskSignature(task, tuple(inputs.values()), first.outputs, first.metric)


def _no_cycle(task: str, graph: Graph, pipelines: Mapping[str, PipelineMeta]) -> None:
    """``PipelineRefused`` (``cycle``) when ``task`` runs itself, through any depth of registered pipelines."""
    direct = [t for t, _ in graph.stages] + [t for t, _ in graph.branches]
    path: list[str] = [task]

    def visit(t: str) -> None:
        if t == task or t in path:
            raise _refuse(f"pipeline {task!r} would run itself: {' -> '.join([*path, t])}", "cycle", task)
        p = pipelines.get(t)
        if p is None:
            return
        path.append(t)
        for sub in p.tasks():
            visit(sub)
        path.pop()

    for t in dict.fromkeys(direct):
        visit(t)


def decode_pipeline(key: str, value: Any) -> PipelineMeta:
    """The entry at ``pipelines/<task>``; ``ValueError``, only that, for anything else."""
    try:
        meta = PipelineMeta.from_json(value)
    except Exception as exc:  # hostile input: RecursionError, OverflowError, TypeError are as likely
        raise ValueError(str(exc)[:300] or type(exc).__name__) from exc
    parts = key.split("/")
    if len(parts) != 2 or f"{parts[0]}/" != PIPELINES or meta.task != parts[1]:
        raise ValueError(f"the entry names task {meta.task!r}, not its key's")
    return meta


async def read_signatures(store: Store) -> dict[str, TaskSignature]:
    """Every catalogued task's signature that decodes (the rest are the catalog's to report)."""
    out: dict[str, TaskSignature] = {}
    for item in await store.get_prefix(CATALOG):
        parts = item.key.split("/")
        if len(parts) == 3 and parts[2] == TASK_NAME:
            try:
                s = signature_from_json(item.value)
            except Exception:  # untrusted; Catalog.read reports it
                continue
            out[s.task] = s
    return out


async def read_pipelines(store: Store) -> PipelineReading:
    out = PipelineReading()
    for item in await store.get_prefix(PIPELINES):
        parts = item.key.split("/")
        try:
            out.pipelines.append(decode_pipeline(item.key, item.value))
        except ValueError as exc:
            out.broken.append(BrokenEntry(item.key, parts[-1], "", f"malformed pipeline: {exc}"))
    out.pipelines.sort(key=lambda p: p.task)
    return out


async def get_pipeline(store: Store, task: str) -> PipelineMeta:
    kv = await store.get(_key(task))
    if kv is None:
        raise CatalogError(f"no pipeline {task!r}", task=task)
    try:
        return decode_pipeline(kv.key, kv.value)
    except ValueError as exc:
        raise CatalogError(f"malformed pipeline at {kv.key!r}: {exc}", task=task) from exc


async def register_pipeline(store: Store, task: str, graph: Graph, *, owner: str = PUBLIC,
                            accuracy: float | None = None, heldout_rows: int = 0,
                            stage_accuracy: Mapping[str, float] | None = None) -> PipelineMeta:
    """Check ``graph`` against the catalog as it is now and write it (replacing the task's entry, if any)."""
    signatures = await read_signatures(store)
    pipelines = {p.task: p for p in (await read_pipelines(store)).pipelines}
    stages, branches, sig = plan_graph(task, graph, signatures, pipelines)
    try:
        meta = PipelineMeta(task=task, kind=graph.kind, stages=stages, signature=sig,  # type: ignore[arg-type]
                            select=graph.select, table=graph.table, branches=branches, accuracy=accuracy,
                            heldout_rows=heldout_rows, stage_accuracy=tuple(sorted((stage_accuracy or {}).items())),
                            owner=owner, created=time.time())
    except ValueError as exc:
        raise _refuse(str(exc), "graph", task) from exc
    await store.put(_key(task), meta.to_json())
    return meta


async def remove_pipeline(store: Store, task: str) -> None:
    key = _key(task)
    if await store.get(key) is None:
        raise CatalogError(f"no pipeline {task!r} (`tiermesh variants pipelines`)", task=task)
    await store.delete(key)


def _key(task: str) -> str:
    try:
        return pipeline_key(task)
    except ValueError as exc:
        raise CatalogError(str(exc), task=task) from exc
