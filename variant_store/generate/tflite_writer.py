"""A full-integer INT8 ``.tflite`` written from an ONNX MLP or small CNN, without TensorFlow.

The model is built with the flatbuffer object API that ships inside the installed
``ai_edge_litert`` (``schema_py_generated``) by :mod:`variant_store.generate.tflite_emit`, from the
layer chain :mod:`variant_store.generate.tflite_lower` makes. What it lowers is a sequential chain:

* dense layers (``Gemm``, or ``MatMul`` + constant ``Add``) -> ``FULLY_CONNECTED``;
* ``Conv`` (group 1, no dilation, bias optional) -> ``CONV_2D`` with SAME / VALID padding where
  that is exactly ONNX's explicit ``pads``, otherwise an int8 ``PAD`` in front of a VALID conv;
* ``MaxPool`` (no ceil mode, pads exactly SAME or none) -> ``MAX_POOL_2D``;
* ``Relu`` fused into the dense or conv layer before it;
* ``Reshape`` of the (N, F) input to (N, C, H, W) -> ``RESHAPE`` to NHWC, which is the same
  memory order only when C == 1 or H * W == 1 (anything else is refused);
* ``Flatten`` (or a 2-D ``Reshape``) of a 4-D tensor, absorbed by the next dense layer: ONNX
  flattens NCHW, TFLite holds NHWC, so that layer's weight columns are permuted at conversion
  time instead of paying for a ``TRANSPOSE`` per query.

Anything else is refused up front with ``UnsupportedOp`` naming the op and the node.

Quantization follows TFLite's integer spec: activations asymmetric int8 per tensor, ranges from
running the float chain (numpy, NHWC, the lowered weights) over the calibration inputs; weights
symmetric int8 per output channel (``quantized_dimension`` 0) or per tensor; bias int32 with
scale = input scale x weight scale. Reshape, pad and max-pool keep their input's scale, as the
int8 kernels require. Input and output tensors are int8; ``TFLiteRuntime`` quantizes /
dequantizes at the boundary. The float chain is checked against ONNX Runtime on the calibration
inputs before anything is written, so a graph this writer misreads (a wrong transpose, a wrong
padding) is an error, not a silently wrong variant.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from mesh.errors import VariantBuildError
from variant_store.generate.tflite_emit import emit_int8_model
from variant_store.generate.tflite_lower import act_qparams, extract_layers, float_forward

__all__ = ["write_tflite_int8"]


def _check_against_onnx(model_bytes: bytes, in_name: str, out_name: str, x: np.ndarray,
                        ref: np.ndarray) -> None:
    import onnxruntime as ort

    sess = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    got = sess.run([out_name], {in_name: x})[0]
    if got.shape != ref.shape or not np.allclose(got, ref, rtol=1e-3, atol=1e-3):
        raise VariantBuildError("TFLite writer: float chain disagrees with ONNX Runtime; graph misread")


def write_tflite_int8(parent: Path, calib_x: np.ndarray, out: Path, *, per_channel: bool = True) -> Path:
    """Write ``out`` as a full-integer INT8 TFLite model of the sequential ONNX model at ``parent``."""
    if len(calib_x) == 0:
        raise VariantBuildError("TFLite writer: calibration inputs are empty")
    model_bytes = Path(parent).read_bytes()
    in_name, out_name, layers = extract_layers(onnx.load_from_string(model_bytes))
    x = np.ascontiguousarray(calib_x, dtype=np.float32)
    acts = float_forward(layers, x)
    _check_against_onnx(model_bytes, in_name, out_name, x, acts[-1])
    data = emit_int8_model(layers, [act_qparams(a) for a in acts], in_name, out_name,
                           x.shape[1], per_channel=per_channel)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return out
