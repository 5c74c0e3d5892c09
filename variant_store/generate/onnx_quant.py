"""ONNX variants of one FP32 parent: a verbatim copy, INT8 dynamic, INT8 static (QDQ) and FP16.

Dynamic INT8 suits MLPs and transformers; ONNX Runtime's dynamic quantizer does not take
``Gemm``, so Gemm nodes are first rewritten to ``MatMul`` + ``Add`` (the weights transposed once,
offline). Static QDQ suits CNNs and calibrates on the registered validation inputs. FP16 keeps
float32 inputs and outputs so every variant of a task has the same signature.

Every writer ends in ``_canonical_save``: the producer fields are fixed and the model serialized
deterministically, so regenerating from the same inputs gives the same bytes (and digest).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mesh.errors import VariantBuildError

__all__ = [
    "copy_fp32",
    "gemm_to_matmul",
    "quantize_fp16",
    "quantize_int8_dynamic",
    "quantize_int8_static",
]

PRODUCER = "tiermesh.variant_store"


def _canonical_save(model: onnx.ModelProto, out: Path) -> Path:
    model.producer_name = PRODUCER
    model.producer_version = "1"
    model.doc_string = ""
    del model.metadata_props[:]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(model.SerializeToString(deterministic=True))
    return out


def copy_fp32(parent: Path, out: Path) -> Path:
    """The parent itself, byte for byte: its digest must match what the owner registered."""
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(parent, out)
    return out


def gemm_to_matmul(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite plain ``Gemm`` (alpha = beta = 1, no transA, constant B) as ``MatMul`` + ``Add``."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {t.name: t for t in m.graph.initializer}
    new_nodes: list[onnx.NodeProto] = []
    for node in m.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        rewritable = (node.op_type == "Gemm" and node.input[1] in inits
                      and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
                      and not attrs.get("transA", 0))
        if not rewritable:
            new_nodes.append(node)
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        if attrs.get("transB", 0):
            w = np.ascontiguousarray(w.T)
        wname = f"{node.input[1]}__kn"
        m.graph.initializer.append(numpy_helper.from_array(w, wname))
        base = node.name or node.output[0]
        has_bias = len(node.input) > 2 and node.input[2]
        mm_out = f"{base}__mm" if has_bias else node.output[0]
        new_nodes.append(helper.make_node("MatMul", [node.input[0], wname], [mm_out], name=f"{base}/MatMul"))
        if has_bias:
            new_nodes.append(helper.make_node("Add", [mm_out, node.input[2]], [node.output[0]],
                                              name=f"{base}/Add"))
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    used = {i for n in m.graph.node for i in n.input}
    keep = [t for t in m.graph.initializer if t.name in used]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    return m


def quantize_int8_dynamic(parent: Path, out: Path, *, per_channel: bool = True) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = gemm_to_matmul(onnx.load(str(parent)))
    with tempfile.TemporaryDirectory(prefix="tm-qdyn-") as tmp:
        src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        onnx.save(model, str(src))
        try:
            quantize_dynamic(src, dst, per_channel=per_channel, weight_type=QuantType.QInt8)
        except Exception as exc:  # the quantizer raises bare Exceptions / ValueErrors
            raise VariantBuildError(f"int8 dynamic quantization failed: {exc}") from exc
        q = onnx.load(str(dst))
    if not any(n.op_type in {"MatMulInteger", "DynamicQuantizeLinear", "ConvInteger",
                             "DynamicQuantizeMatMul"} for n in q.graph.node):
        raise VariantBuildError("int8 dynamic quantization quantized no node (no MatMul / Conv / Gemm)")
    return _canonical_save(q, out)


class _ArrayReader:
    """CalibrationDataReader over a float32 array, fed in fixed-size chunks, in order."""

    def __init__(self, input_name: str, x: np.ndarray, chunk: int = 64) -> None:
        self._input_name = input_name
        self._batches: Iterator[np.ndarray] = iter(
            [np.ascontiguousarray(x[i:i + chunk], dtype=np.float32) for i in range(0, len(x), chunk)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else {self._input_name: batch}

    def rewind(self) -> None:  # part of CalibrationDataReader's interface; one pass is all we need
        pass


def quantize_int8_static(parent: Path, out: Path, calib_x: np.ndarray, *, per_channel: bool = True) -> Path:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_static,
    )

    if len(calib_x) == 0:
        raise VariantBuildError("int8 static quantization needs calibration inputs; got none")
    model = onnx.load(str(parent))
    input_name = model.graph.input[0].name
    reader = _ArrayReader(input_name, calib_x)
    CalibrationDataReader.register(_ArrayReader)
    with tempfile.TemporaryDirectory(prefix="tm-qstat-") as tmp:
        pre, dst = Path(tmp) / "pre.onnx", Path(tmp) / "out.onnx"
        try:
            quant_pre_process(str(parent), str(pre))
            quantize_static(pre, dst, reader,  # type: ignore[arg-type]
                            quant_format=QuantFormat.QDQ, per_channel=per_channel,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.MinMax,
                            calibration_providers=["CPUExecutionProvider"])
        except Exception as exc:  # shape inference / calibration errors are untyped
            raise VariantBuildError(f"int8 static quantization failed: {exc}") from exc
        q = onnx.load(str(dst))
    return _canonical_save(q, out)


def quantize_fp16(parent: Path, out: Path) -> Path:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    try:
        half = convert_float_to_float16(onnx.load(str(parent)), keep_io_types=True)
    except Exception as exc:
        raise VariantBuildError(f"fp16 conversion failed: {exc}") from exc
    return _canonical_save(half, out)
