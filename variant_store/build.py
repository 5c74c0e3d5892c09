"""Register a model owner's ONNX model, then generate, measure and catalog its variants.

``register_model`` stores the FP32 parent and its labelled validation set as blobs and records
them at ``models/<task>/<family>``. ``build_task`` turns every registered model of a task into
variants: generate (INT8, FP16, TFLite, ... where this machine can), measure accuracy on the
held-out rows (the first ``calib_count`` rows of the validation set are calibration data and are
never scored), profile on this machine's hardware class, store the bytes, write the metadata.
Profiles measured on other hardware classes are kept when a variant is rebuilt here.
"""

from __future__ import annotations

import asyncio
import inspect
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import onnx

from mesh.errors import CatalogError, MeshError, VariantBuildError
from mesh.log import get_logger, kv
from mesh.types import TaskSignature, TensorSpec
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog, RegisteredModel
from variant_store.meta import Format, Precision, Profile, VariantMeta
from variant_store.model_check import ModelLimits, check_upload
from variant_store.profiler import add_base_latency, run_first_output
from variant_store.runtimes.text import TEXT_SPEC, TOKENIZER_KEY
from variant_store.sandbox import SandboxLimits, run_sandboxed_async

__all__ = [
    "BATCH_SIZES",
    "BuildReport",
    "Skipped",
    "build_task",
    "ensure_digits_family",
    "load_validation",
    "profile_to_meta",
    "register_model",
    "reprofile",
    "signature_from_onnx",
]

log = get_logger(__name__)
BATCH_SIZES: tuple[int, ...] = (1, 8, 32)
T = TypeVar("T")


@dataclass(slots=True)
class Skipped:
    task: str
    family: str
    kind: str
    reason: str


@dataclass(slots=True)
class BuildReport:
    task: str
    hardware_class: str = ""
    built: list[VariantMeta] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "hardware_class": self.hardware_class,
                "built": [{"variant": m.variant_id, "digest": m.blob_digest, "accuracy": m.accuracy,
                           "size_bytes": m.size_bytes} for m in self.built],
                "skipped": [{"family": s.family, "kind": s.kind, "reason": s.reason} for s in self.skipped]}


# helpers --------------------------------------------------------------------------------------

def signature_from_onnx(task: str, path: Path, metric: str = "top1") -> TaskSignature:
    """The task signature a model implies: its graph inputs (initializers excluded) and outputs;
    symbolic or unknown dimensions become -1."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ValueError... for a bad file
        raise VariantBuildError(f"not a readable ONNX model: {path}: {exc}") from exc
    inits = {i.name for i in model.graph.initializer}

    def spec(vi: onnx.ValueInfoProto) -> TensorSpec:
        tt = vi.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
        return TensorSpec(name=vi.name, dtype=dtype, shape=shape)

    inputs = tuple(spec(v) for v in model.graph.input if v.name not in inits)
    if any(p.key == TOKENIZER_KEY for p in model.metadata_props):
        inputs = (TEXT_SPEC,)  # it carries its tokenizer: callers send text (variant_store.runtimes.text)
    return TaskSignature(task=task, inputs=inputs, outputs=tuple(spec(v) for v in model.graph.output),
                         metric=metric)


def load_validation(path: Path) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(x, y or None, calib_count) from a validation ``.npz``; rows before calib_count calibrate."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            x = np.ascontiguousarray(npz["x"])
            y = np.asarray(npz["y"]) if "y" in npz.files else None
            calib = int(np.asarray(npz["calib_count"]).reshape(-1)[0]) if "calib_count" in npz.files else 0
    except (OSError, KeyError, ValueError) as exc:
        raise VariantBuildError(f"bad validation set {path}: need arrays x[, y, calib_count]: {exc}") from exc
    if x.dtype.kind == "U":  # text rows (stored without pickle): the BYTES tensor a caller would send
        x = np.array([t.encode() for t in x.tolist()], dtype=object)
    if calib <= 0 or calib >= len(x):
        calib = max(1, len(x) // 4)  # no split recorded: calibrate on a quarter, score the rest
    return x, y, calib


def profile_to_meta(result: Any) -> Profile:
    """The profiler's result as the catalog's ``Profile`` type, stamped now."""
    prof: Profile = result.to_profile()
    return prof


async def _off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run blocking work (quantizing, profiling, hashing) off the event loop."""
    out = await asyncio.get_running_loop().run_in_executor(None, partial(fn, *args, **kwargs))
    if inspect.isawaitable(out):
        out = await out
    return out


# register ---------------------------------------------------------------------------------------

async def register_model(catalog: Catalog, blobs: BlobStore, onnx_path: Path | str, val_npz: Path | str,
                         task: str, family: str, owner: str = "public", metric: str = "top1", *,
                         role: str = "model", base_digest: str | None = None,
                         limits: ModelLimits | None = None) -> RegisteredModel:
    """Check the parent model (``variant_store.model_check``: ``ModelRejected``, nothing stored), store it and
    its validation set; record the task's signature on first use.

    A task's signature is fixed by its first model: a model with different inputs is refused
    (callers name the task, not the model, so every variant must accept the same tensors). A family another
    task holds is refused (``CatalogError``, nothing written): variant ids are unique across the mesh."""
    onnx_path, val_npz = Path(onnx_path), Path(val_npz)
    if metric not in ("top1", "cosine"):
        raise CatalogError(f"unknown metric {metric!r}: top1 or cosine")
    await check_upload(onnx_path, limits)  # hostile bytes are refused before anything else parses them
    # before anything is stored: a family another task holds would give its variants that task's ids
    await catalog.check_family_free(task, family)
    sig = signature_from_onnx(task, onnx_path, metric)
    if role == "head":
        # callers of a head's task send what its backbone takes: the task's inputs are the backbone's
        if not base_digest or not blobs.has(base_digest):
            raise CatalogError(f"head {family!r} needs its backbone's blob (base_digest) stored first")
        base_sig = signature_from_onnx(task, blobs.path(base_digest))
        sig = TaskSignature(task=task, inputs=base_sig.inputs, outputs=sig.outputs, metric=metric)
    x, y, _ = load_validation(val_npz)
    if metric == "top1" and y is None:
        raise VariantBuildError(f"{val_npz}: metric top1 needs labels (array 'y')")
    try:
        known = await catalog.get_task(task)
    except CatalogError:
        await catalog.put_task(sig)
    else:
        if [(s.name, s.shape[1:]) for s in known.inputs] != [(s.name, s.shape[1:]) for s in sig.inputs]:
            raise CatalogError(f"{onnx_path} inputs {sig.inputs} differ from task {task!r}'s "
                               f"{known.inputs}", task=task)
    parent = await _off_loop(blobs.put_file, onnx_path)
    val = await _off_loop(blobs.put_file, val_npz)
    model = RegisteredModel(task=task, family=family, parent_digest=parent, validation_digest=val,
                            owner=owner, metric=metric, role=role, base_digest=base_digest)
    await catalog.put_model(model)
    log.info("registered %s/%s (%d validation rows)", task, family, len(x),
             extra=kv(task=task, tenant=owner, event="model_registered"))
    return model


# build ----------------------------------------------------------------------------------------

async def build_task(catalog: Catalog, blobs: BlobStore, task: str, *, families: Sequence[str] | None = None,
                     kinds: Sequence[str] | None = None, progress: bool = True,
                     repeats: int = 50, batch_sizes: Sequence[int] = BATCH_SIZES,
                     sandbox: SandboxLimits | None = None) -> BuildReport:
    """Generate, measure and catalog the variants of every registered model of ``task``. Each model is
    generated and measured in a limited child process (``sandbox``; ``variant_store.sandbox``): one that
    crashes, hangs or exhausts memory there is reported skipped (kind ``*``) and the others still build."""
    models = [m for m in await catalog.list_models(task) if families is None or m.family in families]
    if not models:
        within = f" in families {list(families)}" if families else ""
        raise CatalogError(f"no registered models for task {task!r}{within}", task=task)
    for model in models:  # a registration older than the check: refused before any work
        await catalog.check_family_free(task, model.family)
    sig = await catalog.get_task(task)
    report = BuildReport(task=task)
    with _progress(progress) as prog, tempfile.TemporaryDirectory(prefix="tiermesh-build-") as tmp:
        for model in models:
            work = Path(tmp) / model.family
            work.mkdir()
            await _build_model(catalog, blobs, model, sig, work, kinds, repeats,
                               tuple(batch_sizes), report, prog, sandbox)
    return report


async def _build_model(catalog: Catalog, blobs: BlobStore, model: RegisteredModel, sig: TaskSignature,
                       work: Path, kinds: Sequence[str] | None, repeats: int, batch_sizes: tuple[int, ...],
                       report: BuildReport, prog: Any, sandbox: SandboxLimits | None) -> None:
    from variant_store.measure import measure_model

    await _off_loop(blobs.verify, model.parent_digest)
    await _off_loop(blobs.verify, model.validation_digest)
    x, y, calib = load_validation(blobs.path(model.validation_digest))
    parent_id = f"{model.family}.onnx.fp32"
    base_digest = model.base_digest if model.role == "head" else None
    if base_digest:
        await _off_loop(blobs.verify, base_digest)
    try:  # the owner's bytes are parsed and run only in a child with memory, CPU and time limits
        measured, skipped = await run_sandboxed_async(
            measure_model,
            (blobs.path(model.parent_digest), model.role, model.metric, x, y, calib, work,
             list(kinds) if kinds is not None else None, batch_sizes, repeats,
             blobs.path(base_digest) if base_digest else None),
            limits=sandbox, label=f"building {model.task}/{model.family}")
    except MeshError as exc:  # whatever the model did to the child, it fails this model's build only
        report.skipped.append(Skipped(model.task, model.family, "*", str(exc)))
        log.warning("building %s/%s failed: %s", model.task, model.family, exc,
                    extra=kv(task=model.task, event="build_failed", reason=exc.details.get("limit")))
        return
    for s in skipped:
        report.skipped.append(Skipped(model.task, model.family, s.kind, s.reason))
        log.info("skipped %s.%s: %s", model.family, s.kind, s.reason,
                 extra=kv(task=model.task, reason=s.reason))
    task_id = prog.add_task(f"{model.task}/{model.family}", total=len(measured)) if prog else None
    for gen, result in measured:
        variant_id = f"{model.family}.{gen.kind}"
        if isinstance(result, str):  # profiling failed in the child: the reason, not the variant
            report.skipped.append(Skipped(model.task, model.family, gen.kind, result))
            log.warning("%s: %s", variant_id, result, extra=kv(task=model.task, variant=variant_id))
            if prog:
                prog.advance(task_id)
            continue
        digest = await _off_loop(blobs.put_file, gen.path)
        prof = profile_to_meta(result)
        report.hardware_class = prof.hardware_class
        meta = VariantMeta(
            task=model.task, family=model.family, variant_id=variant_id, format=cast(Format, gen.format),
            precision=cast(Precision, gen.precision), runtime=gen.runtime, blob_digest=digest,
            size_bytes=blobs.size(digest),
            accuracy=float(result.accuracy), metric=model.metric, batch_sizes=list(batch_sizes),
            inputs=_specs(sig.inputs),  # a head is served behind its backbone: callers send task inputs
            outputs=_specs(sig.outputs), parent=None if variant_id == parent_id else parent_id,
            shared_base_digest=base_digest, owner=model.owner,
            profiles=await _merged_profiles(catalog, model.task, variant_id, digest, prof),
        )
        await catalog.put_variant(meta)
        report.built.append(meta)
        log.info("built %s: accuracy %.4f, %d bytes", variant_id, meta.accuracy, meta.size_bytes,
                 extra=kv(task=model.task, variant=variant_id, event="variant_built"))
        if prog:
            prog.advance(task_id)


def _profile(gen: Any, x: np.ndarray, y: np.ndarray | None, metric: str, batch_sizes: tuple[int, ...],
             repeats: int, reference: np.ndarray | None) -> Any:
    from variant_store.profiler import profile_variant

    return profile_variant(gen.format, gen.path, x, y, metric=metric, batch_sizes=batch_sizes,
                           repeats=repeats, reference_outputs=reference)


async def _merged_profiles(catalog: Catalog, task: str, variant_id: str, digest: str,
                           prof: Profile) -> dict[str, Profile]:
    try:
        old = await catalog.get_variant(task, variant_id)
    except CatalogError:
        return {prof.hardware_class: prof}
    # timings of other hardware are still true only if the bytes they measured are the same
    kept = dict(old.profiles) if old.blob_digest == digest else {}
    kept[prof.hardware_class] = prof
    return kept


def _specs(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    return [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs]


class _progress:
    """A rich progress display on stderr, or nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._p: Any = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), console=Console(stderr=True), transient=False)
        self._p.__enter__()
        return self._p

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.__exit__(None, None, None)


async def reprofile(catalog: Catalog, blobs: BlobStore, task: str, variant_id: str, *,
                    repeats: int = 50) -> VariantMeta:
    """Measure an existing variant on this machine's hardware class and add that profile (accuracy
    is measured again too: it must not depend on where it was measured, and a change is logged)."""
    meta = await catalog.get_variant(task, variant_id)
    model = await catalog.get_model(task, meta.family)
    await _off_loop(blobs.verify, meta.blob_digest)
    x, y, calib = load_validation(blobs.path(model.validation_digest))
    x_hold, y_hold = x[calib:], (y[calib:] if y is not None else None)
    if meta.shared_base_digest:
        x_hold = (await _off_loop(run_first_output, blobs.path(meta.shared_base_digest), x))[calib:]
    reference = None
    if meta.metric == "cosine":
        reference = await _off_loop(run_first_output, blobs.path(model.parent_digest), x_hold)
    from variant_store.generate import GeneratedVariant

    gen = GeneratedVariant(variant_id, meta.format, meta.precision, blobs.path(meta.blob_digest),
                           meta.runtime)
    result = await _off_loop(_profile, gen, x_hold, y_hold, meta.metric, tuple(meta.batch_sizes), repeats,
                             reference)
    if meta.shared_base_digest:
        result = await _off_loop(add_base_latency, result, blobs.path(meta.shared_base_digest), x[calib:],
                                 tuple(meta.batch_sizes), repeats)
    prof = profile_to_meta(result)
    if abs(float(result.accuracy) - meta.accuracy) > 0.005:
        log.warning("%s accuracy %.4f here vs %.4f recorded", variant_id, result.accuracy, meta.accuracy,
                    extra=kv(task=task, variant=variant_id))
    meta.profiles[prof.hardware_class] = prof
    await catalog.put_variant(meta)
    return meta


# the committed digits family -------------------------------------------------------------------

# Labels each digits task is scored on, from the digit labels in digits_val.npz; the parity head
# was trained on y % 2 (variant_store/families/digits.py).
_DIGITS_LABELS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"digit-parity": lambda y: y % 2}
_ROLE_ORDER = {"backbone": 0, "model": 1, "head": 2}  # a head's backbone blob must be stored first


async def ensure_digits_family(catalog: Catalog, blobs: BlobStore, *, directory: Path | str | None = None,
                               repeats: int = 20, force: bool = False, progress: bool = True,
                               kinds: Sequence[str] | None = None) -> list[BuildReport]:
    """Register and build the committed digits family (``variant_store/models/digits``): every
    classifier model, the shared backbone (task ``digit-features``, scored as cosine fidelity to
    itself) and the tenant heads (``shared_base_digest`` = the backbone). Entries whose family
    already has variants are left alone unless ``force``. Returns one report per task built."""
    from variant_store.families.datasets import DIGITS_DIR, load_digits_manifest

    root = Path(directory) if directory is not None else DIGITS_DIR
    manifest = load_digits_manifest(root)
    val_path = root / manifest["dataset"]["file"]
    have = {(v.task, v.family) for v in await catalog.list_variants()}
    todo: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="tiermesh-digits-") as tmp:
        for e in sorted(manifest["models"], key=lambda e: _ROLE_ORDER.get(e["role"], 9)):
            if not force and (e["task"], e["family"]) in have:
                continue
            path = root / e["file"]
            got = await _off_loop(_sha256, path)
            if got != e["sha256"]:
                raise VariantBuildError(f"{path}: sha256 {got} does not match the manifest's {e['sha256']}")
            base = await _off_loop(blobs.put_file, root / e["backbone"]) if e["role"] == "head" else None
            val = val_path
            if e["task"] in _DIGITS_LABELS:
                val = Path(tmp) / f"{e['task']}.npz"
                await _off_loop(_relabel, val_path, val, _DIGITS_LABELS[e["task"]])
            await register_model(catalog, blobs, path, val, e["task"], e["family"], owner=e["owner"],
                                 metric=e.get("metric") or "cosine", role=e["role"], base_digest=base)
            todo.setdefault(e["task"], []).append(e["family"])
        reports = []
        for task, fams in todo.items():
            reports.append(await build_task(catalog, blobs, task, families=fams, kinds=kinds,
                                            progress=progress, repeats=repeats))
    from variant_store.cascade import digits_default_stages, ensure_cascade  # the built-in cascade (issue 33)

    task = "digit-classification"
    await ensure_cascade(catalog, blobs, task, digits_default_stages(await catalog.list_variants(task)),
                         rebuilt=task in todo, load_rows=load_validation)
    return reports


def _sha256(path: Path) -> str:
    from variant_store.blobs import sha256_file

    try:
        return sha256_file(path)
    except OSError as exc:
        raise VariantBuildError(f"cannot read {path}: {exc}") from exc


def _relabel(src: Path, dest: Path, fn: Callable[[np.ndarray], np.ndarray]) -> None:
    x, y, calib = load_validation(src)
    if y is None:
        raise VariantBuildError(f"{src} has no labels to derive {dest.stem} labels from")
    np.savez(dest, x=x, y=fn(y), calib_count=np.asarray(calib, dtype=np.int64))
