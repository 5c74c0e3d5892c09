"""Measure any pipeline end to end (issue 33, item 2): its top-1 on labelled rows, run through its graph as the
door runs it, so the catalog can say what accuracy it promises.

Each row goes through the graph by the rules the door serves it by (:func:`variant_store.pipeline_meta.feed`,
:func:`variant_store.pipeline_meta.switch_rows`, shared with ``edge_agent.pipeline_exec``): a stage's inputs fed by
name from the pipeline's inputs and the stage before, a Switch's rows split by the argmax of its selector's output
and answered by their branches, merged back in order. Each stage task is run, offline and as it is served (a head
behind its shared backbone: :func:`variant_store.profiler.run_first_output`), by its most accurate variant that the
pipeline's owner may use (public or the owner's, not a version drawing no traffic, of a format this host runs on its
CPU: ONNX or TFLite). Each such variant's accuracy becomes the stage's floor (``PipelineMeta.stage_accuracy``): the
stage queries ask for it, so the pipeline is served by variants at least as accurate as those it was measured with.

The rows: at most :data:`MAX_ROWS` (the first ones), run :data:`BATCH_ROWS` at a time through the whole graph. A
validation file (:func:`load_rows`) is an ``.npz`` holding one array per pipeline input, by its name, and
``labels``: one integer class per row.

Errors::

    PipelineRefused reason  validation    the rows: not an .npz, an input missing, unknown or of another dtype or
                                          shape, labels missing, not integers or not one per row, or outside the
                                          classes the pipeline answers
                            metric        the pipeline's first output is not (rows, classes) scores
                            nested        a stage is itself a pipeline (its own stages' floors would decide how it
                                          is served, not the variants measured here)
                            unknown_task  a stage task has no variant the owner may use that runs here
    CatalogError, BlobError, RuntimeLoadError   from the catalog, the blobs and the runtimes, as they come
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mesh.errors import BadTensor, MeshError, PipelineRefused
from mesh.etcd.store import Store
from mesh.types import TaskSignature, check_inputs
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.meta import PUBLIC, VariantMeta
from variant_store.pipeline_catalog import Graph, plan_graph, read_pipelines, read_signatures
from variant_store.pipeline_meta import PipelineMeta, feed, switch_rows

__all__ = ["BATCH_ROWS", "LABELS", "MAX_ROWS", "Measurement", "Rows", "check_rows", "choose_variant", "load_rows",
           "measure_pipeline", "plan_pipeline", "run_graph"]

MAX_ROWS = 5000       # a measurement's rows at most: the first ones
BATCH_ROWS = 1000     # rows run through the whole graph at a time
CHUNK = 256           # rows per runtime call, as variant_store.cascade.stage_logits runs a stage
LABELS = "labels"     # the validation file's array of labels
RUNS_HERE = ("onnx", "tflite")  # formats measured on this host's CPU (a TensorRT variant needs its GPU)

# runs one stage task on its fed inputs and returns all its outputs, by name, one row per input row
StageRunner = Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass(frozen=True, slots=True)
class Rows:
    """Labelled rows checked against a pipeline's signature: its inputs by name and one label per row."""

    inputs: dict[str, np.ndarray]
    labels: np.ndarray  # int64, (rows,)

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True, slots=True)
class Measurement:
    """What a pipeline measured end to end, and with which variant of each stage task."""

    task: str
    accuracy: float
    rows: int
    stage_accuracy: dict[str, float]   # stage task -> the accuracy of the variant that ran it (its floor)
    variants: dict[str, str]           # stage task -> that variant's id
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "accuracy": self.accuracy, "rows": self.rows,
                "stage_accuracy": dict(self.stage_accuracy), "variants": dict(self.variants),
                "seconds": round(self.seconds, 3)}


def _refuse(msg: str, reason: str, task: str) -> PipelineRefused:
    return PipelineRefused(msg, reason=reason, task=task)


# pure -------------------------------------------------------------------------------------------

def check_rows(signature: TaskSignature, arrays: Mapping[str, np.ndarray], max_rows: int = MAX_ROWS) -> Rows:
    """``arrays`` (the pipeline's inputs by name and :data:`LABELS`) as :class:`Rows`, the first ``max_rows`` of
    them; ``PipelineRefused`` (``validation``) for inputs the pipeline's door would refuse or labels that are not
    one integer per row. Numbers are cast to the input's dtype of their kind (a float64 ``x`` where float32 is
    expected), text (``<U``) to the bytes a caller sends, as the variants' validation sets are read."""
    task = signature.task
    names = [s.name for s in signature.inputs]
    if LABELS not in arrays:
        raise _refuse(f"the validation rows have no {LABELS!r} array (they hold {sorted(arrays)})", "validation", task)
    missing = [n for n in names if n not in arrays]
    extra = sorted(set(arrays) - {*names, LABELS})
    if missing or extra:
        raise _refuse(f"pipeline {task!r} takes inputs {names} (and {LABELS!r}): the validation rows "
                      f"{'lack ' + str(missing) if missing else ''}{' and ' if missing and extra else ''}"
                      f"{'hold unknown ' + str(extra) if extra else ''}", "validation", task)
    labels = np.asarray(arrays[LABELS])
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels.reshape(-1)
    if labels.ndim != 1 or labels.dtype.kind not in "iu" or not len(labels):
        raise _refuse(f"{LABELS!r} must hold one integer class per row, not {labels.dtype}{list(labels.shape)}",
                      "validation", task)
    n = min(len(labels), max(1, max_rows))
    inputs: dict[str, np.ndarray] = {}
    for spec in signature.inputs:
        a = np.asarray(arrays[spec.name])
        if a.ndim == 0 or a.shape[0] != len(labels):
            raise _refuse(f"input {spec.name!r} has {a.shape[0] if a.ndim else 0} rows, {LABELS!r} "
                          f"{len(labels)}: one label per row", "validation", task)
        a = a[:n]
        if a.dtype.kind == "U":  # text stored without pickle: the BYTES tensor a caller would send
            a = np.array([t.encode() for t in a.reshape(-1).tolist()], dtype=object).reshape(a.shape)
        elif a.dtype.kind in "fiu" and np.dtype(spec.dtype).kind == a.dtype.kind:
            a = a.astype(spec.dtype, copy=False)
        inputs[spec.name] = a
    try:
        checked = check_inputs(signature.inputs, inputs)
    except BadTensor as exc:
        raise _refuse(f"the validation rows do not fit pipeline {task!r}: {exc.message}", "validation", task) from exc
    return Rows(checked, labels[:n].astype(np.int64))


def choose_variant(variants: Sequence[VariantMeta], owner: str) -> VariantMeta | None:
    """The variant a measurement runs a stage task by: the most accurate that ``owner`` may use (public or its
    own) and that draws traffic, of a format this host runs (ties: the smaller, then by id); None if none."""
    usable = [m for m in variants if m.owner in (PUBLIC, owner) and m.share > 0 and m.format in RUNS_HERE]
    return min(usable, key=lambda m: (-m.accuracy, m.size_bytes, m.variant_id), default=None)


def run_graph(meta: PipelineMeta, inputs: Mapping[str, np.ndarray], run: StageRunner) -> dict[str, np.ndarray]:
    """The pipeline's outputs for ``inputs``, each stage task run by ``run``, routed as the door routes a query
    (``MeshError`` for what cannot run: a feed with nothing to feed it, a selector's class out of the table)."""
    n = max((int(a.shape[0]) for a in inputs.values() if a.ndim), default=1)
    if meta.kind == "sequence":
        prev: dict[str, np.ndarray] = {}
        for st in meta.stages:
            prev = run(st.task, feed(st, inputs, prev))
        return prev
    selector = meta.stages[0]
    sel = run(selector.task, feed(selector, inputs, {}))
    parts = []
    for task, rows in switch_rows(meta, sel.get(meta.select), n).items():
        whole = len(rows) == n
        st = meta.branch(task)
        fed = feed(st, inputs if whole else _take(inputs, rows), sel if whole else _take(sel, rows))
        parts.append((rows, run(task, fed)))
    return _merge(parts, n)


def _take(arrays: Mapping[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(a[rows]) for name, a in arrays.items()}


def _merge(parts: list[tuple[np.ndarray, dict[str, np.ndarray]]], n: int) -> dict[str, np.ndarray]:
    """One output per name for the ``n`` rows from each branch's answer to its rows (every row answered once)."""
    first = parts[0][1]
    out = {name: np.empty((n, *a.shape[1:]), dtype=a.dtype) for name, a in first.items()}
    for rows, outputs in parts:
        for name, a in out.items():
            got = outputs.get(name)
            if got is None or got.shape != (len(rows), *a.shape[1:]) or got.dtype != a.dtype:
                raise MeshError(f"the switch's branches answer {name!r} differently")
            a[rows] = got
    return out


def _top1(meta: PipelineMeta, outputs: Mapping[str, np.ndarray], labels: np.ndarray) -> np.ndarray:
    """Per row, whether the argmax of the pipeline's first output is its label."""
    name = meta.signature.outputs[0].name
    scores = outputs.get(name)
    if scores is None or scores.ndim != 2 or scores.shape[0] != len(labels):
        got = "nothing" if scores is None else f"{list(scores.shape)}"
        raise _refuse(f"pipeline {meta.task!r} answers {name!r} {got}: top-1 needs ({len(labels)}, classes)",
                      "metric", meta.task)
    if labels.min() < 0 or labels.max() >= scores.shape[1]:
        raise _refuse(f"labels outside the {scores.shape[1]} classes pipeline {meta.task!r} answers", "validation",
                      meta.task)
    return np.asarray(scores.argmax(axis=1) == labels)


# running the stages ------------------------------------------------------------------------------

class _Stages:
    """Each stage task's chosen variant, loaded once for the whole measurement (blocking: use from one thread)."""

    def __init__(self, chosen: Mapping[str, VariantMeta], blobs: BlobStore, stack: contextlib.ExitStack) -> None:
        from variant_store.runtimes import open_runtime

        self._run: dict[str, Any] = {}
        self._base: dict[str, Path | None] = {}
        for task, m in chosen.items():
            rt = open_runtime(m.format, blobs.path(m.blob_digest), intra_op_threads=2)
            rt.load_sync()
            stack.callback(rt.unload_sync)
            self._run[task] = rt
            self._base[task] = blobs.path(m.shared_base_digest) if m.shared_base_digest else None

    def __call__(self, task: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from variant_store.profiler import run_first_output

        rt, base = self._run[task], self._base[task]
        if base is not None:
            # served as a head behind its backbone: the backbone's first output into the head's first input
            if len(inputs) != 1:
                raise MeshError(f"stage {task!r} runs on a shared backbone, which takes one input, not "
                                f"{sorted(inputs)}")
            inputs = {rt.input_specs[0].name: run_first_output(base, next(iter(inputs.values())))}
        n = max((int(a.shape[0]) for a in inputs.values() if a.ndim), default=1)
        chunks = [rt.infer_sync({k: np.ascontiguousarray(a[i:i + CHUNK]) for k, a in inputs.items()})
                  for i in range(0, n, CHUNK)]
        return {name: np.concatenate([np.asarray(c[name]) for c in chunks]) for name in chunks[0]}


def _measure(meta: PipelineMeta, chosen: Mapping[str, VariantMeta], blobs: BlobStore, rows: Rows,
             batch_rows: int) -> np.ndarray:
    """Whether each row's answer is right (blocking)."""
    with contextlib.ExitStack() as stack:
        run = _Stages(chosen, blobs, stack)
        right = []
        for i in range(0, len(rows), batch_rows):
            part = {k: v[i:i + batch_rows] for k, v in rows.inputs.items()}
            right.append(_top1(meta, run_graph(meta, part, run), rows.labels[i:i + batch_rows]))
        return np.concatenate(right)


# I/O ---------------------------------------------------------------------------------------------

def load_rows(path: Path, signature: TaskSignature, max_rows: int = MAX_ROWS) -> Rows:
    """The labelled rows of the ``.npz`` at ``path`` for the pipeline of ``signature`` (:func:`check_rows`);
    ``PipelineRefused`` (``validation``) for a file that is not an ``.npz`` of plain arrays."""
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError("a single array, not an .npz of named arrays")
        with npz:
            arrays = {k: np.asarray(npz[k]) for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise _refuse(f"{path}: not an .npz of the pipeline's inputs and {LABELS!r}: {exc}", "validation",
                      signature.task) from exc
    return check_rows(signature, arrays, max_rows)


async def plan_pipeline(store: Store, task: str, graph: Graph, *, owner: str = PUBLIC) -> PipelineMeta:
    """The unmeasured entry ``register_pipeline`` would write for ``graph`` now (checked the same way,
    ``PipelineRefused``); nothing is written."""
    signatures = await read_signatures(store)
    pipelines = {p.task: p for p in (await read_pipelines(store)).pipelines}
    stages, branches, sig = plan_graph(task, graph, signatures, pipelines)
    try:
        return PipelineMeta(task=task, kind=graph.kind, stages=stages, signature=sig,  # type: ignore[arg-type]
                            select=graph.select, table=graph.table, branches=branches, owner=owner)
    except ValueError as exc:
        raise _refuse(str(exc), "graph", task) from exc


async def measure_pipeline(catalog: Catalog, blobs: BlobStore, meta: PipelineMeta, rows: Rows, *,
                           batch_rows: int = BATCH_ROWS) -> Measurement:
    """``meta``'s top-1 end to end on ``rows`` (see the module docstring); nothing is written."""
    t0 = time.perf_counter()
    pipelines = {p.task for p in (await read_pipelines(catalog.store)).pipelines}
    chosen: dict[str, VariantMeta] = {}
    for task in meta.tasks():
        if task in pipelines:
            raise _refuse(f"stage {task!r} is itself a pipeline: measuring a pipeline of pipelines is not "
                          f"supported", "nested", meta.task)
        m = choose_variant((await catalog.read(task)).variants, meta.owner)
        if m is None:
            raise _refuse(f"stage task {task!r} has no variant that owner {meta.owner!r} may use and this host "
                          f"runs ({', '.join(RUNS_HERE)})", "unknown_task", meta.task)
        for d in (m.blob_digest, m.shared_base_digest):
            if d:
                await asyncio.to_thread(blobs.verify, d)
        chosen[task] = m
    right = await asyncio.to_thread(_measure, meta, chosen, blobs, rows, max(1, batch_rows))
    return Measurement(task=meta.task, accuracy=float(right.mean()), rows=len(rows),
                       stage_accuracy={t: m.accuracy for t, m in chosen.items()},
                       variants={t: m.variant_id for t, m in chosen.items()}, seconds=time.perf_counter() - t0)
