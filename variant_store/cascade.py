"""Calibrate a cascade of a task's variants (issue 33): choose the thresholds on one half of the task's validation
rows, measure what the router will believe on the other half.

Why two halves: a threshold chosen on the rows it is scored on flatters itself (it is fitted to their noise), and the
router trusts a cascade's ``accuracy`` exactly as it trusts a variant's. So the held-out rows of the validation set
(those every variant's accuracy is measured on: ``x[calib_count:]``, :func:`variant_store.build.load_validation`) are
split, seeded and stratified by label, into a calibration half and a held-out half. Every stage runs once on all of
them (a head behind its backbone, as it is served); thresholds are chosen on the calibration half to make the fewest
rows escalate while the cascade's top-1 there stays at least ``target_accuracy`` (default: the last stage's own top-1
on that half minus 0.3 points, the issue's "within 0.3 points of the large variant alone"); ``accuracy`` and
``escalation`` are then measured on the held-out half and written to the catalog.

The threshold search (:func:`choose_thresholds`) is pure: exact for two stages (every distinct confidence is a
candidate, the threshold set midway between neighbours), a small grid of confidence quantiles per stage for three or
more. A target no threshold reaches is refused (``CascadeRefused``, reason ``unreachable``), never relaxed.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from mesh.errors import CascadeRefused, CatalogError
from mesh.log import get_logger, kv
from variant_store.blobs import BlobStore
from variant_store.cascade_catalog import check_stages, stage_owner
from variant_store.cascade_meta import RULES, CascadeMeta, Rule, confidence
from variant_store.catalog import Catalog
from variant_store.meta import PUBLIC, VariantMeta

__all__ = ["DEFAULT_MARGIN", "SEED", "Calibration", "RowsLoader", "answered_by", "calibrate", "choose_thresholds",
           "default_cascade_id", "digits_default_stages", "ensure_cascade", "evaluate", "register_cascade",
           "split_rows", "stage_logits"]

log = get_logger(__name__)
# a validation ``.npz`` as (x, y or None, calib_count): ``variant_store.build.load_validation``, passed in by the
# callers (build imports this module for the families' built-in cascades, so this one cannot import build)
RowsLoader = Callable[[Path], tuple[np.ndarray, np.ndarray | None, int]]
SEED = 33                 # the split is the same on every machine and every run
DEFAULT_MARGIN = 0.003    # default target: the last stage's top-1 on the calibration half minus 0.3 points
GRID = 21                 # threshold candidates per stage when there are three stages or more
_EPS = 1e-12


# pure -------------------------------------------------------------------------------------------

def split_rows(y: np.ndarray, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """(calibration, held-out) row indices: each label's rows shuffled by ``seed`` and dealt alternately, so the
    halves have the same label mix and differ in size by at most one row per label."""
    y = np.asarray(y).reshape(-1)
    rng = np.random.default_rng(seed)
    cal: list[np.ndarray] = []
    held: list[np.ndarray] = []
    for label in np.unique(y):
        rows = np.flatnonzero(y == label)
        rows = rows[rng.permutation(len(rows))]
        cal.append(rows[0::2])
        held.append(rows[1::2])
    return np.sort(np.concatenate(cal)).astype(np.int64), np.sort(np.concatenate(held)).astype(np.int64)


def answered_by(conf: np.ndarray, thresholds: Sequence[float]) -> np.ndarray:
    """The stage answering each row: the first ``i`` with ``conf[i] >= thresholds[i]``, else the last stage.
    ``conf``: (stages - 1, rows)."""
    conf = np.asarray(conf, dtype=np.float64)
    out = np.full(conf.shape[1], len(thresholds), dtype=np.int64)
    for i in reversed(range(len(thresholds))):
        out = np.where(conf[i] >= thresholds[i], i, out)
    return out


def evaluate(conf: np.ndarray, correct: np.ndarray, thresholds: Sequence[float]) -> tuple[float, tuple[float, ...]]:
    """(top-1 of the cascade, share of rows reaching stage ``i + 1`` for each threshold). ``correct``:
    (stages, rows) booleans, whether each stage's answer for a row is right."""
    by = answered_by(conf, thresholds)
    n = by.shape[0]
    acc = float(np.asarray(correct)[by, np.arange(n)].mean())
    return acc, tuple(float(np.mean(by > i)) for i in range(len(thresholds)))


def choose_thresholds(conf: np.ndarray, correct: np.ndarray, target: float, *, grid: int = GRID) -> tuple[float, ...]:
    """The thresholds (in [0, 1]) that make the fewest rows escalate with the cascade's top-1 >= ``target`` on
    these rows; for three stages or more, the fewest escalations summed over the stages (then the fewest reaching
    the last), searched over ``grid`` quantiles of each stage's confidence. ``CascadeRefused`` when none reaches
    ``target`` (not even escalating every row: the last stage alone falls short)."""
    conf = np.asarray(conf, dtype=np.float64)
    correct = np.asarray(correct, dtype=bool)
    if conf.ndim != 2 or correct.shape != (conf.shape[0] + 1, conf.shape[1]) or conf.shape[1] == 0:
        raise ValueError(f"need conf (stages - 1, rows) and correct (stages, rows), not {conf.shape}, "
                         f"{correct.shape}")
    best = _two_stages(conf[0], correct, target) if conf.shape[0] == 1 else _grid(conf, correct, target, grid)
    if best is None:
        last = float(correct[-1].mean())
        raise CascadeRefused(f"no threshold reaches top-1 {target:.4f} on the {conf.shape[1]} calibration rows "
                             f"(the last stage alone: {last:.4f}, the first alone: {float(correct[0].mean()):.4f})",
                             reason="unreachable", target=target)
    return best


def _two_stages(conf: np.ndarray, correct: np.ndarray, target: float) -> tuple[float, ...] | None:
    """Exact: escalating the ``k`` least confident rows, for every ``k`` that a threshold can cut at."""
    order = np.argsort(conf, kind="stable")
    cs, c1, c2 = conf[order], correct[0][order], correct[1][order]
    n = len(cs)
    escalated_right = np.concatenate([[0], np.cumsum(c2)])
    local_right = int(c1.sum()) - np.concatenate([[0], np.cumsum(c1)])
    acc = (escalated_right + local_right) / n
    cut = np.ones(n + 1, dtype=bool)
    cut[1:n] = cs[:-1] < cs[1:]           # ties fall on one side of a threshold together
    cut[n] = cs[-1] < 1.0                 # every row escalates only if a threshold <= 1 exceeds them all
    ok = np.flatnonzero(cut & (acc >= target - _EPS))
    if ok.size == 0:
        return None
    k = int(ok[0])
    if k == 0:
        return (0.0,)
    if k == n:
        return (1.0,)
    mid = (cs[k - 1] + cs[k]) / 2
    return (float(mid if mid > cs[k - 1] else cs[k]),)


def _grid(conf: np.ndarray, correct: np.ndarray, target: float, grid: int) -> tuple[float, ...] | None:
    cands = [np.unique(np.concatenate([[0.0, 1.0], np.quantile(c, np.linspace(0.0, 1.0, max(2, grid)))]))
             for c in conf]
    best: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    for ts in itertools.product(*cands):
        acc, esc = evaluate(conf, correct, ts)
        if acc < target - _EPS:
            continue
        key = (sum(esc), *reversed(esc), *ts)
        if best is None or key < best[0]:
            best = (key, tuple(float(t) for t in ts))
    return None if best is None else best[1]


def default_cascade_id(stages: Sequence[str]) -> str:
    """``<first>-to-<last>`` of the stages' ids; a digest when that would pass 128 characters."""
    name = "-to-".join(stages)
    return name if len(name) <= 128 else "cascade-" + hashlib.sha256(name.encode()).hexdigest()[:24]


def digits_default_stages(variants: Sequence[VariantMeta]) -> tuple[str, str] | None:
    """The built-in digits cascade: the smallest public INT8 variant, then the most accurate public one (ties: the
    smaller); ``None`` when there is no INT8 variant or it is already the most accurate."""
    public = [m for m in variants if m.owner == PUBLIC and m.metric == "top1"]
    small = sorted((m for m in public if m.precision == "int8"), key=lambda m: (m.size_bytes, m.variant_id))
    large = sorted(public, key=lambda m: (-m.accuracy, m.size_bytes, m.variant_id))
    if not small or not large or small[0].variant_id == large[0].variant_id:
        return None
    return small[0].variant_id, large[0].variant_id


# running the stages ------------------------------------------------------------------------------

def stage_logits(fmt: str, path: Path, x: np.ndarray, base_path: Path | None = None) -> np.ndarray:
    """A stage's first output for every row of ``x``, run as it is served: a head on its backbone's features
    (:func:`variant_store.profiler.run_first_output`, cached per rows), 256 rows at a time. Blocking."""
    from variant_store.profiler import run_first_output
    from variant_store.runtimes import open_runtime

    if base_path is not None:
        x = run_first_output(base_path, x)
    if x.dtype.kind in "fiu":
        x = np.ascontiguousarray(x, dtype=np.float32)
    rt = open_runtime(fmt, Path(path), intra_op_threads=2)
    rt.load_sync()
    try:
        name, out = rt.input_specs[0].name, rt.output_specs[0].name
        return np.concatenate([np.asarray(rt.infer_sync({name: x[i:i + 256]})[out]) for i in range(0, len(x), 256)])
    finally:
        rt.unload_sync()


@dataclass(frozen=True, slots=True)
class Calibration:
    """A calibrated cascade and what it was measured against (for the CLI's table and the logs)."""

    meta: CascadeMeta
    stage_accuracy: tuple[float, ...]     # each stage alone on the held-out half
    seconds: float                        # running the stages and searching

    def to_json(self) -> dict[str, Any]:
        return {**self.meta.to_json(), "stage_accuracy_heldout": list(self.stage_accuracy),
                "seconds": round(self.seconds, 3)}


async def calibrate(catalog: Catalog, blobs: BlobStore, task: str, stages: Sequence[str], *,
                    load_rows: RowsLoader, rule: str = "max_softmax", target_accuracy: float | None = None,
                    cascade_id: str | None = None, seed: int = SEED,
                    progress: Callable[[str], None] | None = None) -> Calibration:
    """Calibrate a cascade of ``task``'s catalogued ``stages`` (cheapest first) on its validation split; nothing
    is written (:func:`register_cascade` writes). ``CascadeRefused`` for stages that are not the task's top-1
    variants of one output signature, an unknown rule, a target out of [0, 1] or one no threshold reaches.
    ``load_rows``: :func:`variant_store.build.load_validation`."""
    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    if rule not in RULES:
        raise CascadeRefused(f"unknown confidence rule {rule!r}: one of {list(RULES)}", reason="rule")
    if target_accuracy is not None and not 0.0 <= target_accuracy <= 1.0:
        raise CascadeRefused(f"target accuracy {target_accuracy} is not in [0, 1]", reason="unreachable")
    sig = await catalog.get_task(task)
    if sig.metric != "top1":
        raise CascadeRefused(f"task {task!r} is scored {sig.metric!r}: a cascade needs top-1", reason="metric")
    metas = check_stages(task, tuple(stages), (await catalog.read(task)).variants)
    owner = stage_owner(metas)
    model = await catalog.get_model(task, metas[-1].family)  # the rows every stage's accuracy was measured on
    await asyncio.to_thread(blobs.verify, model.validation_digest)
    x, y, calib = await asyncio.to_thread(load_rows, blobs.path(model.validation_digest))
    if y is None:
        raise CascadeRefused(f"task {task!r}'s validation set has no labels", reason="metric")
    x, y = x[calib:], np.asarray(y[calib:]).reshape(-1).astype(np.int64)
    if len(y) < 4:
        raise CascadeRefused(f"task {task!r} has {len(y)} held-out validation rows: too few to split",
                             reason="rows")
    outs = []
    for i, m in enumerate(metas):
        say(f"stage {i + 1}/{len(metas)}: running {m.variant_id} on {len(y)} validation rows")
        for d in (m.blob_digest, m.shared_base_digest):
            if d:
                await asyncio.to_thread(blobs.verify, d)
        base = blobs.path(m.shared_base_digest) if m.shared_base_digest else None
        outs.append(await asyncio.to_thread(stage_logits, m.format, blobs.path(m.blob_digest), x, base))
    classes = {o.shape[1] if o.ndim == 2 else -1 for o in outs}
    if len(classes) != 1 or -1 in classes or any(len(o) != len(y) for o in outs):
        raise CascadeRefused(f"the stages' outputs differ: {[o.shape for o in outs]}", reason="stages")
    if y.min() < 0 or y.max() >= outs[0].shape[1]:
        raise CascadeRefused(f"labels outside the {outs[0].shape[1]} classes the stages answer", reason="metric")
    correct = np.stack([o.argmax(axis=1) == y for o in outs])
    conf = np.stack([confidence(cast(Rule, rule), o) for o in outs[:-1]])
    cal, held = split_rows(y, seed)
    target = target_accuracy if target_accuracy is not None else max(
        0.0, float(correct[-1][cal].mean()) - DEFAULT_MARGIN)
    say(f"choosing {len(metas) - 1} threshold(s) on {len(cal)} calibration rows for top-1 >= {target:.4f}")
    thresholds = choose_thresholds(conf[:, cal], correct[:, cal], target)
    accuracy, escalation = evaluate(conf[:, held], correct[:, held], thresholds)
    meta = CascadeMeta(task=task, cascade_id=cascade_id or default_cascade_id(stages), stages=tuple(stages),
                       rule=cast(Rule, rule), thresholds=thresholds, accuracy=accuracy, escalation=escalation,
                       target_accuracy=float(target), calibration_rows=len(cal), heldout_rows=len(held),
                       owner=owner, created=time.time())
    return Calibration(meta, tuple(float(c[held].mean()) for c in correct), time.perf_counter() - t0)


async def register_cascade(catalog: Catalog, blobs: BlobStore, task: str, stages: Sequence[str],
                           **kwargs: Any) -> Calibration:
    """:func:`calibrate`, then catalog the result (``cascades/<task>/<id>``; an entry of that id is replaced)."""
    cal = await calibrate(catalog, blobs, task, stages, **kwargs)
    await catalog.put_cascade(cal.meta)
    m = cal.meta
    log.info("cascade %s/%s: thresholds %s, held-out top-1 %.4f (stages alone %s), escalation %s, %d+%d rows, "
             "%.2fs", task, m.cascade_id, [round(t, 4) for t in m.thresholds], m.accuracy,
             [round(a, 4) for a in cal.stage_accuracy], [round(e, 3) for e in m.escalation], m.calibration_rows,
             m.heldout_rows, cal.seconds, extra=kv(task=task, event="cascade_registered"))
    return cal


async def ensure_cascade(catalog: Catalog, blobs: BlobStore, task: str, stages: Sequence[str] | None, *,
                         rebuilt: bool, load_rows: RowsLoader) -> Calibration | None:
    """The built-in cascade of a family (``ensure_digits_family``, ``ensure_text_family``): calibrated and
    registered when the task was just (re)built or has no cascade of these stages yet. A cascade the figures
    refuse is logged, not raised: the family still serves without it."""
    if stages is None:
        return None
    try:
        known = {c.stages for c in await catalog.cascades(task)}
        if not rebuilt and tuple(stages) in known:
            return None
        return await register_cascade(catalog, blobs, task, stages, load_rows=load_rows)
    except (CascadeRefused, CatalogError) as exc:
        log.warning("no built-in cascade for %s (%s): %s", task, list(stages), exc,
                    extra=kv(task=task, event="cascade_refused"))
        return None
