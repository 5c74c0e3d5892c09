"""Variant generation: from one registered FP32 ONNX model and its calibration inputs, every
variant this host can produce, plus a reason for each one it cannot.

A generator failing never stops the others: its failure becomes a ``SkippedVariant``. Outputs
are deterministic (same parent and calibration data -> same bytes), so a regenerated variant
keeps its digest and its catalog entry.
"""

from __future__ import annotations

from mesh.extras import require

require("store", "onnx", "onnxruntime", "sympy")

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mesh.errors import MeshError
from mesh.log import get_logger, kv
from variant_store.generate import onnx_quant, tensorrt_gen
from variant_store.generate.tflite_writer import write_tflite_int8

__all__ = ["ALL_KINDS", "KIND_INFO", "GeneratedVariant", "SkippedVariant", "generate_variants",
           "tflite_writer_available"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class GeneratedVariant:
    kind: str          # e.g. "onnx.int8-dynamic"
    format: str        # "onnx" | "tflite" | "tensorrt"
    precision: str     # "fp32" | "fp16" | "int8"
    path: Path
    runtime: str       # "onnxruntime" | "tflite" | "tensorrt"


@dataclass(frozen=True, slots=True)
class SkippedVariant:
    kind: str
    reason: str        # e.g. "TFLite writer: unsupported op Conv at node 'conv1'"


# kind -> (format, precision, runtime, file suffix)
KIND_INFO: dict[str, tuple[str, str, str, str]] = {
    "onnx.fp32": ("onnx", "fp32", "onnxruntime", ".onnx"),
    "onnx.int8-dynamic": ("onnx", "int8", "onnxruntime", ".onnx"),
    "onnx.int8-static": ("onnx", "int8", "onnxruntime", ".onnx"),
    "onnx.fp16": ("onnx", "fp16", "onnxruntime", ".onnx"),
    "tflite.int8": ("tflite", "int8", "tflite", ".tflite"),
    "tensorrt.fp16": ("tensorrt", "fp16", "tensorrt", ".engine"),
}
ALL_KINDS: tuple[str, ...] = tuple(KIND_INFO)


def _builders(calib_x: np.ndarray) -> dict[str, Callable[[Path, Path], Path]]:
    return {
        "onnx.fp32": onnx_quant.copy_fp32,
        "onnx.int8-dynamic": onnx_quant.quantize_int8_dynamic,
        "onnx.int8-static": lambda p, o: onnx_quant.quantize_int8_static(p, o, calib_x),
        "onnx.fp16": onnx_quant.quantize_fp16,
        "tflite.int8": lambda p, o: write_tflite_int8(p, calib_x, o),
        "tensorrt.fp16": lambda p, o: tensorrt_gen.build_tensorrt_fp16(p, o, features=calib_x.shape[-1]),
    }


def tflite_writer_available() -> bool:
    return importlib.util.find_spec("ai_edge_litert") is not None


def generate_variants(parent: Path, calib_x: np.ndarray, out_dir: Path, *,
                      kinds: list[str] | None = None) -> tuple[list[GeneratedVariant], list[SkippedVariant]]:
    """Write each requested variant of ``parent`` into ``out_dir`` as ``<parent stem>.<kind><suffix>``."""
    parent = Path(parent)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = list(kinds) if kinds is not None else list(ALL_KINDS)
    builders = _builders(np.asarray(calib_x, dtype=np.float32))
    made: list[GeneratedVariant] = []
    skipped: list[SkippedVariant] = []
    for kind in wanted:
        if kind not in KIND_INFO:
            skipped.append(SkippedVariant(kind, f"unknown variant kind; known: {list(ALL_KINDS)}"))
            continue
        fmt, precision, runtime, suffix = KIND_INFO[kind]
        if kind == "tensorrt.fp16":
            ok, why = tensorrt_gen.available()
            if not ok:
                skipped.append(SkippedVariant(kind, why))
                continue
        if kind == "tflite.int8" and not tflite_writer_available():
            # the writer builds its flatbuffer with ai-edge-litert's schema: absent (a GPU image, an SDK-only
            # install), the variant is skipped with the reason, not a crash per model
            skipped.append(SkippedVariant(kind, "ai-edge-litert is not installed (pip install 'tiermesh[agent]')"))
            continue
        out = out_dir / f"{parent.stem}.{kind}{suffix}"
        try:
            builders[kind](parent, out)
        except MeshError as exc:
            skipped.append(SkippedVariant(kind, exc.message))
        except Exception as exc:  # one broken generator must not cost the others their variants
            log.warning("variant generator crashed", exc_info=True, extra=kv(variant=kind, event="build"))
            skipped.append(SkippedVariant(kind, f"{type(exc).__name__}: {exc}"))
        else:
            made.append(GeneratedVariant(kind, fmt, precision, out, runtime))
            continue
        out.unlink(missing_ok=True)
        log.info("variant skipped", extra=kv(variant=kind, reason=skipped[-1].reason))
    return made, skipped
