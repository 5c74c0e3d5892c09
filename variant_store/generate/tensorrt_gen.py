"""TensorRT FP16 engines, built from the FP32 ONNX parent on a GPU host.

An engine is specific to the GPU model and TensorRT version that built it, so it is built on
the site that will run it. Where no GPU or no ``tensorrt`` is present, ``available()`` gives the
reason and the generator reports a skipped variant instead of failing the build.
"""

from __future__ import annotations

from pathlib import Path

from mesh.errors import VariantBuildError
from variant_store.hardware import tensorrt_available

__all__ = ["available", "build_tensorrt_fp16"]


def available() -> tuple[bool, str]:
    """(True, how) when a TensorRT engine can be built here, else (False, reason)."""
    ok, why = tensorrt_available()
    if not ok:
        return False, why
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False, "building engines needs the tensorrt package (only the ORT TensorRT provider is here)"
    return True, why


def build_tensorrt_fp16(parent: Path, out: Path, *, max_batch: int = 32, features: int | None = None,
                        workspace_bytes: int = 1 << 30) -> Path:
    """Build a serialized FP16 engine with a dynamic batch profile 1..``max_batch``."""
    ok, why = available()
    if not ok:
        raise VariantBuildError(f"tensorrt.fp16: {why}")
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(Path(parent).read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise VariantBuildError(f"tensorrt.fp16: ONNX parse failed: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        inp = network.get_input(i)
        rest = tuple(int(d) for d in inp.shape[1:])
        if features is not None and len(rest) == 1:
            rest = (features,)
        profile.set_shape(inp.name, (1, *rest), (max(1, max_batch // 4), *rest), (max_batch, *rest))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise VariantBuildError("tensorrt.fp16: engine build failed")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(bytes(engine))
    return out
