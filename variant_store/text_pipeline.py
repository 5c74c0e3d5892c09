"""The text family's two-stage pipeline (issue 33, item 2): ``text-group`` picks one of the 4 groups, then a
per-group head on the same embedding picks the section (the 10 ``text-topic`` sections), a Switch registered as
task ``text-section`` (tenant ``globex``, whose ``text-group`` is).

The per-group heads are linear layers (multinomial logistic regression) over one encoder's embeddings of the
training rows of the group's sections, exported to ONNX as the family's heads are (``embedding`` -> ``logits``),
with all 10 section logits: a section outside the group gets weight 0 and bias :data:`OUTSIDE` (never the argmax),
so every branch answers in the same classes as the flat topic head. A one-section group's head is that constant.
They are registered as the tasks ``text-section-<group>`` (their validation rows: the group's rows of the
validation split, labelled by section) and built as FP32 heads on that encoder.

The pipeline's accuracy is measured end to end on the held-out rows (after ``CALIB_COUNT``) with the encoder's
``text-group`` head choosing the branch, against the flat 10-way ``text-topic`` head on the same rows and
embedding; the figure goes into the catalog entry, and each stage's variant accuracy becomes the floor its stage
queries ask. Embeddings are cached beside the family (keyed by the encoder's digest), so a rebuild takes seconds.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mesh.log import get_logger
from variant_store.blobs import BlobStore
from variant_store.build import _off_loop, _sha256, build_task, register_model
from variant_store.catalog import Catalog
from variant_store.pipeline_catalog import Graph, register_pipeline

__all__ = ["BACKBONE_PREFERENCE", "OUTSIDE", "PIPELINE_TASK", "PipelineReport", "ensure_text_pipeline",
           "group_task"]

log = get_logger(__name__)
PIPELINE_TASK = "text-section"
OWNER = "globex"
OUTSIDE = -30.0  # bias of a section outside a group head's group: exp(-30) next to any in-group logit
# the encoder the heads are fitted on, best first among those built
BACKBONE_PREFERENCE = ("minilm-l6-int8", "minilm-l6", "minilm-l3-int8", "minilm-l2-int8")


def group_task(group: str) -> str:
    return f"text-section-{group}"


@dataclass(frozen=True, slots=True)
class PipelineReport:
    backbone: str
    accuracy: float          # the pipeline's top-1 on the held-out rows
    flat_accuracy: float     # the flat 10-way topic head's, same rows, same embedding
    group_accuracy: float    # text-group's alone
    heldout_rows: int
    seconds: float


def _embeddings(root: Path, backbone: str, texts: dict[str, list[str]], cache: Path) -> dict[str, np.ndarray]:
    """Each split's embeddings by ``backbone``, cached under ``cache`` by the encoder file's digest."""
    from variant_store.families.text import _embed

    path = root / f"{backbone}.onnx"
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / f"embed-{_sha256(path)[:16]}.npz"
    try:
        with np.load(dest, allow_pickle=False) as npz:
            got = {k: np.asarray(npz[k]) for k in texts}
        if all(len(got[k]) == len(v) for k, v in texts.items()):
            return got
    except (OSError, KeyError, ValueError):
        pass
    got = {k: _embed(path, v) for k, v in texts.items()}
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".npz")
    os.close(fd)
    try:
        np.savez(tmp, **got)  # type: ignore[arg-type]  # numpy's stub wants positional arrays too
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return got


def _group_head(x: np.ndarray, y: np.ndarray, sections: list[int], classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(weight (d, classes), bias (classes,)) of a head choosing among ``sections`` only."""
    w = np.zeros((x.shape[1], classes), dtype=np.float32)
    b = np.full(classes, OUTSIDE, dtype=np.float32)
    if len(sections) == 1:
        b[sections[0]] = 0.0
        return w, b
    from sklearn.linear_model import LogisticRegression

    keep = np.isin(y, sections)
    clf = LogisticRegression(C=20.0, max_iter=3000).fit(x[keep], y[keep])
    cols = [int(c) for c in clf.classes_]
    w[:, cols] = clf.coef_.T
    b[cols] = clf.intercept_
    return w, b


def _write_head(w: np.ndarray, b: np.ndarray, dest: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["embedding", "head.weight"], ["z"]),
             helper.make_node("Add", ["z", "head.bias"], ["logits"])]
    graph = helper.make_graph(
        nodes, dest.stem, [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", w.shape[0]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", w.shape[1]])],
        initializer=[numpy_helper.from_array(w, "head.weight"), numpy_helper.from_array(b, "head.bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tiermesh.text")
    model.ir_version = 8
    onnx.save(model, str(dest))


def _logits(head: Path, feats: np.ndarray) -> np.ndarray:
    from variant_store.runtimes import open_runtime

    rt = open_runtime("onnx", head)
    rt.load_sync()
    try:
        return np.asarray(rt.infer_sync({"embedding": feats.astype(np.float32)})["logits"])
    finally:
        rt.unload_sync()


@dataclass(frozen=True, slots=True)
class _Fitted:
    heads: dict[str, Path]            # group -> head file
    validation: dict[str, Path]       # group -> validation npz
    accuracy: float
    flat: float
    group_acc: float
    heldout: int


def _fit_all(root: Path, backbone: str, work: Path, cache: Path) -> _Fitted:
    """Fit, write and measure (blocking: run off the loop)."""
    from variant_store.families.text_corpus import CALIB_COUNT, GROUPS, SECTIONS, Corpus, load_corpus

    corpus = load_corpus()
    emb = _embeddings(root, backbone, {"train": corpus.train_text, "val": corpus.val_text}, cache)
    heads, vals = {}, {}
    val_groups = Corpus.group_of(corpus.val_y)
    texts = np.array(corpus.val_text)
    per_group: dict[int, np.ndarray] = {}
    for g, (group, secs) in enumerate(GROUPS.items()):
        w, b = _group_head(emb["train"], corpus.train_y, [SECTIONS.index(s) for s in secs], len(SECTIONS))
        heads[group] = work / f"section-{group}-{backbone}.onnx"
        _write_head(w, b, heads[group])
        rows = np.flatnonzero(val_groups == g)
        calib = int((rows < CALIB_COUNT).sum())
        vals[group] = work / f"section-{group}_val.npz"
        np.savez(vals[group], x=texts[rows], y=corpus.val_y[rows],
                 calib_count=np.asarray(max(1, calib), dtype=np.int64))
        per_group[g] = _logits(heads[group], emb["val"])
    hold = slice(CALIB_COUNT, None)
    y = corpus.val_y[hold]
    picked = _logits(root / f"group-{backbone}.onnx", emb["val"][hold]).argmax(1)
    stacked = np.stack([per_group[g][hold] for g in range(len(GROUPS))])  # (groups, rows, classes)
    answer = stacked[picked, np.arange(len(picked))].argmax(1)
    flat = _logits(root / f"topic-{backbone}.onnx", emb["val"][hold]).argmax(1)
    return _Fitted(heads, vals, float(np.mean(answer == y)), float(np.mean(flat == y)),
                   float(np.mean(picked == Corpus.group_of(y))), len(y))


async def ensure_text_pipeline(catalog: Catalog, blobs: BlobStore, root: Path, manifest: dict[str, Any], *,
                               cache_dir: Path, built: set[str], repeats: int = 5, force: bool = False,
                               progress: bool = True, say: Callable[[str], None] | None = None
                               ) -> PipelineReport | None:
    """Fit, register and build the per-group heads on the best encoder whose ``text-group`` and ``text-topic``
    heads are catalogued, measure the Switch and register it (``text-section``). Left alone when its entry exists
    and its heads are catalogued, unless ``force``. None when no such encoder is built."""
    import time

    from variant_store.families.text_corpus import GROUPS
    from variant_store.pipeline_catalog import get_pipeline

    have = {(v.task, v.family): v for v in await catalog.list_variants()}
    backbone = next((b for b in BACKBONE_PREFERENCE if b in built and ("text-group", f"group-{b}") in have
                     and ("text-topic", f"topic-{b}") in have), None)
    if backbone is None:
        return None
    fams = {group_task(g): f"section-{g}-{backbone}" for g in GROUPS}
    if not force and all((t, f) in have for t, f in fams.items()):
        try:
            await get_pipeline(catalog.store, PIPELINE_TASK)
            return None
        except Exception:  # absent or broken: registered again below
            pass
    t0 = time.monotonic()
    base = next(e for e in manifest["models"] if e["role"] == "backbone" and e["family"] == backbone)
    with tempfile.TemporaryDirectory(prefix="text-pipeline-") as tmp:
        fitted = await _off_loop(_fit_all, root, backbone, Path(tmp), cache_dir / "text-pipeline")
        digest = await _off_loop(blobs.put_file, root / base["file"])
        for group in GROUPS:
            task, fam = group_task(group), fams[group_task(group)]
            if (task, fam) in have and not force:
                continue
            await register_model(catalog, blobs, fitted.heads[group], fitted.validation[group], task, fam,
                                 owner=OWNER, metric="top1", role="head", base_digest=digest)
            await build_task(catalog, blobs, task, families=[fam], kinds=["onnx.fp32"], progress=progress,
                             repeats=repeats)
    # each stage's floor: the least accurate variant of the head it was measured with (any of them, or a more
    # accurate head, may serve it)
    floors: dict[str, float] = {}
    for v in await catalog.list_variants():
        if (v.task, v.family) in {("text-group", f"group-{backbone}"), *fams.items()}:
            floors[v.task] = min(floors.get(v.task, 1.0), v.accuracy)
    graph = Graph("switch", (("text-group", None),), "logits",
                  tuple((i, group_task(g)) for i, g in enumerate(GROUPS)),
                  tuple((group_task(g), None) for g in GROUPS))
    await register_pipeline(catalog.store, PIPELINE_TASK, graph, owner=OWNER, accuracy=round(fitted.accuracy, 6),
                            heldout_rows=fitted.heldout, stage_accuracy=floors)
    report = PipelineReport(backbone, fitted.accuracy, fitted.flat, fitted.group_acc, fitted.heldout,
                            time.monotonic() - t0)
    msg = (f"pipeline {PIPELINE_TASK} (text-group -> per-group head, on {backbone}): held-out top-1 "
           f"{report.accuracy:.4f} vs the flat topic head's {report.flat_accuracy:.4f} on {report.heldout_rows} rows "
           f"(groups alone {report.group_accuracy:.4f}), built in {report.seconds:.1f} s")
    (say or log.info)(msg)
    return report
