"""Generate and measure the variants of one registered model: the part of a build that reads the model.

Everything here parses or runs the model owner's bytes (the backbone's features for a head, the parent's
reference outputs, the generators, ONNX Runtime), so ``variant_store.build`` runs ``measure_model`` in a
child process (``variant_store.sandbox``): a model that crashes, hangs or exhausts memory in a converter
fails its own build, not the store. What comes back is plain data; storing blobs and writing the catalog
stay in the parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mesh.errors import MeshError
from mesh.log import get_logger, kv
from variant_store.generate import GeneratedVariant, SkippedVariant, generate_variants
from variant_store.profiler import ProfileResult, add_base_latency, profile_variant, run_first_output

__all__ = ["Measured", "measure_model"]

log = get_logger(__name__)

# each generated variant with its profile, or the reason profiling it failed
Measured = tuple[GeneratedVariant, ProfileResult | str]


def measure_model(parent_path: Path, role: str, metric: str, x: np.ndarray, y: np.ndarray | None, calib: int,
                  work: Path, kinds: Sequence[str] | None, batch_sizes: tuple[int, ...], repeats: int,
                  base_path: Path | None = None) -> tuple[list[Measured], list[SkippedVariant]]:
    """The variants of ``parent_path`` (only the parent itself for a backbone or head, served as registered),
    each profiled on the held-out rows ``x[calib:]``. A head (``base_path`` = its backbone) is measured on the
    backbone's features of the same rows, and its latency is the two together."""
    x_hold, y_hold = x[calib:], (y[calib:] if y is not None else None)
    if base_path is not None:
        feats = run_first_output(base_path, x)
        x_calib, x_hold = feats[:calib], feats[calib:]
    else:
        x_calib = x[:calib]
    reference = run_first_output(parent_path, x_hold) if metric == "cosine" else None
    if role == "model":
        generated, skipped = generate_variants(parent_path, x_calib, work,
                                               kinds=list(kinds) if kinds is not None else None)
    else:
        generated, skipped = [GeneratedVariant("onnx.fp32", "onnx", "fp32", parent_path, "onnxruntime")], []
    measured: list[Measured] = []
    for gen in generated:
        try:
            result = profile_variant(gen.format, gen.path, x_hold, y_hold, metric=metric,
                                     batch_sizes=batch_sizes, repeats=repeats, reference_outputs=reference)
            if base_path is not None:  # a head is served behind its backbone: its latency is both together
                result = add_base_latency(result, base_path, x[calib:], batch_sizes, repeats)
        except MeshError as exc:
            log.warning("profiling %s failed: %s", gen.kind, exc, extra=kv(variant=gen.kind))
            measured.append((gen, f"profiling failed: {exc}"))
            continue
        measured.append((gen, result))
    return measured, skipped
