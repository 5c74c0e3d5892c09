"""Triton's JSON shapes beyond the Open Inference Protocol's core, for a task: its model configuration, its
statistics (the statistics extension) and its repository index entry. Pure functions over a
:class:`~mesh.types.TaskSignature` and counts, no I/O; the edge serves them (``edge_agent.v2_extras``).

Units: the counts' times are milliseconds (as the mesh's timing is); Triton's JSON says nanoseconds (``ns``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mesh.types import TaskSignature, TensorSpec
from mesh.v2.datatypes import BYTES, datatype_named

__all__ = ["CONFIG_MAX_BATCH", "READY", "UNAVAILABLE", "Counts", "config_type", "index_entry",
           "signature_to_config", "stats_entry"]

# What a task's config declares as max_batch_size when its tensors have a batch dimension: the edge accepts any
# number of rows up to its body limit (the mesh batches them), so this is a size for tools (perf_analyzer's -b) to
# stay under, not a limit the edge enforces.
CONFIG_MAX_BATCH = 256
READY, UNAVAILABLE = "READY", "UNAVAILABLE"


def config_type(dtype: str) -> str:
    """Triton's config spelling of a numpy dtype name: ``float32`` -> ``TYPE_FP32``, BYTES -> ``TYPE_STRING``."""
    v2 = datatype_named(dtype)
    return "TYPE_STRING" if v2 == BYTES else "TYPE_" + v2


def _batched(sig: TaskSignature) -> bool:
    return all(s.shape and s.shape[0] == -1 for s in (*sig.inputs, *sig.outputs))


def _tensor(s: TensorSpec, batched: bool) -> dict[str, Any]:
    dims = list(s.shape[1:] if batched else s.shape)
    return {"name": s.name, "data_type": config_type(s.dtype), "dims": dims or [1]}


def signature_to_config(sig: TaskSignature, max_batch_size: int = CONFIG_MAX_BATCH) -> dict[str, Any]:
    """Triton's model configuration (JSON, as ``GET /v2/models/{m}/config`` answers) of a task: the task stands for
    the model, tiermesh for its backend; when every tensor's first dimension is the batch (-1), ``max_batch_size``
    is ``max_batch_size`` and ``dims`` leave that dimension out, as Triton's do (perf_analyzer drops the first
    dimension of the metadata's shapes when ``max_batch_size`` > 0); otherwise 0 and the whole shapes."""
    batched = _batched(sig)
    return {"name": sig.task, "platform": "tiermesh", "backend": "tiermesh",
            "max_batch_size": max_batch_size if batched else 0,
            "dynamic_batching": {},  # the sites batch queries of a variant, across callers
            "input": [_tensor(s, batched) for s in sig.inputs],
            "output": [_tensor(s, batched) for s in sig.outputs],
            "parameters": {"metric": {"string_value": sig.metric}}}


@dataclass(slots=True)
class Counts:
    """Queries one tenant's callers had answered at a door, of one task (and one variant, or all of them)."""

    success: int = 0
    fail: int = 0
    rows: int = 0            # inferences: batch rows, as Triton counts a batch of n as n
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    total_ms: float = 0.0    # the whole time from the query's entry to its answer

    def add(self, other: Counts) -> None:
        self.success += other.success
        self.fail += other.fail
        self.rows += other.rows
        self.queue_ms += other.queue_ms
        self.compute_ms += other.compute_ms
        self.total_ms += other.total_ms


def _dur(count: int, ms: float) -> dict[str, int]:
    return {"count": count, "ns": int(ms * 1e6)}


def stats_entry(name: str, version: str, c: Counts) -> dict[str, Any]:
    """One ``model_stats`` item of Triton's statistics extension. The mesh has no separate input and output
    stages (``compute_input`` / ``compute_output`` are 0 ns) and caches no results (``cache_hit`` / ``cache_miss``
    are zeros, present because perf_analyzer reads them unchecked); a failure's time is not kept (``fail.ns`` is 0);
    ``execution_count`` counts the queries answered, as each is one execution for its caller (the batches a site
    merged them into are counted at that site, in ``nv_inference_*``)."""
    return {"name": name, "version": version, "last_inference": 0,
            "inference_count": c.rows, "execution_count": c.success,
            "inference_stats": {"success": _dur(c.success, c.total_ms), "fail": _dur(c.fail, 0.0),
                                "queue": _dur(c.success, c.queue_ms),
                                "compute_input": _dur(c.success, 0.0),
                                "compute_infer": _dur(c.success, c.compute_ms),
                                "compute_output": _dur(c.success, 0.0),
                                "cache_hit": _dur(0, 0.0), "cache_miss": _dur(0, 0.0)},
            "batch_stats": []}


def index_entry(task: str, ready: bool, reason: str = "") -> dict[str, str]:
    """One item of the repository index: a task, READY or UNAVAILABLE (``reason`` says why)."""
    return {"name": task, "version": "", "state": READY if ready else UNAVAILABLE, "reason": "" if ready else reason}
