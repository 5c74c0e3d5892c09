"""The one place where a query is served. Transports (ZeroMQ server, HTTP front, in-process SDK
transport) are thin adapters over an object that satisfies ``DataPlane``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from mesh.errors import NoRoute
from mesh.types import DEFAULT_TENANT, InferRequest, InferResponse, TaskSignature

__all__ = ["DataPlane", "require_servable", "task_visible"]


def task_visible(owners: Iterable[str], tenant: str) -> bool:
    """Whether ``tenant`` may know of a task whose variants have ``owners``: one is public or its own. A task with
    no variant yet is visible (its signature alone names no owner). Another tenant's private task must answer
    exactly as one that does not exist, on every transport (HTTP, ZeroMQ, the in-process SDK)."""
    none = True
    for owner in owners:
        if owner == DEFAULT_TENANT or owner == tenant:
            return True
        none = False
    return none


@runtime_checkable
class DataPlane(Protocol):
    site: str

    async def infer(self, req: InferRequest) -> InferResponse:
        """Serve ``req`` (locally or by forwarding). Raises ``mesh.errors.MeshError`` subclasses."""
        ...

    def task_signature(self, task: str) -> TaskSignature:
        """The task's input/output signature; raises ``UnknownTask``."""
        ...

    def tasks(self) -> list[str]:
        """Tasks this site can route (served anywhere in the mesh)."""
        ...

    def ready(self) -> bool:
        """True once the site has a routing snapshot and can answer queries."""
        ...


def require_servable(dp: DataPlane, task: str) -> None:
    """A repository ``load`` of ``task`` (REST or gRPC): nothing is loaded, the mesh places; ``NoRoute`` unless the
    task can be served from this site now."""
    if task not in dp.tasks() or not dp.ready():
        raise NoRoute(f"task {task!r} cannot be served here now: no variant of it, or no routing snapshot yet")
