"""What the edge's fronts (REST: :mod:`edge_agent.http_api`, gRPC: :mod:`edge_agent.grpc_api`) decide alike, so a
query gets the same answer whichever protocol brought it: the one refusal for a task the caller may not know of,
the task's signature under that rule, the tenant a query's parameters may not change, the outputs a task has, the
decision trace a query asks for, and the server's version."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from edge_agent.dataplane import DataPlane
from mesh.errors import BadTensor, PermissionDenied, RequestError, UnknownTask
from mesh.tracecontext import new_traceparent, parse_traceparent
from mesh.types import TaskSignature

__all__ = ["Visible", "check_claim", "check_outputs", "server_version", "task_signature", "traceparent_for",
           "unknown_task"]

Visible = Callable[[str, str], bool]  # (task, tenant): may the tenant know the task exists


def unknown_task(task: str) -> UnknownTask:
    """The one answer for a task a caller may not know of, whether it exists or not: same code, status and words
    (the data plane's own messages list the tasks it knows, or say whose a variant is)."""
    return UnknownTask(f"unknown task {task!r}")


def task_signature(dp: DataPlane, visible: Visible | None, task: str, tenant: str) -> TaskSignature:
    """``task``'s signature if ``tenant`` may know of it; else the one refusal (:func:`unknown_task`), whether the
    task is another tenant's or does not exist."""
    if visible is not None and not visible(task, tenant):
        raise unknown_task(task)
    try:
        return dp.task_signature(task)
    except UnknownTask:
        raise unknown_task(task) from None


def check_claim(params: Mapping[str, object], tenant: str) -> None:
    """The body must not choose the tenant: identity comes from the connection."""
    claimed = params.get("tenant")
    if claimed is not None and claimed != tenant:
        raise PermissionDenied(f"parameter tenant {claimed!r} does not match the caller's identity {tenant!r}")


def check_outputs(sig: TaskSignature, wanted: Mapping[str, object] | None) -> None:
    """``BadTensor`` when a query asks for outputs its task does not have."""
    if wanted is not None and (unknown := sorted(set(wanted) - {s.name for s in sig.outputs})):
        raise BadTensor(f"task {sig.task} has no output(s) {unknown}")


def traceparent_for(header: str | None, asked: object) -> str | None:
    """The ``traceparent`` of a query that asks for its trace (``parameters.trace``), under the caller's trace id
    if its ``traceparent`` (``header``) is valid; None when it does not ask."""
    if asked is None or asked is False:
        return None
    if asked is not True:
        raise RequestError(f"parameter trace must be true or false, got {asked!r}")
    parsed = parse_traceparent(header)
    return new_traceparent(parsed[0] if parsed else None)


def server_version() -> str:
    from importlib import metadata  # only when asked: it costs an idle agent ~0.4 MiB (zipfile, csv, email)

    try:
        return metadata.version("tiermesh")
    except metadata.PackageNotFoundError:
        return "0+unknown"
