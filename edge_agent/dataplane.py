"""The one place where a query is served. Transports (ZeroMQ server, HTTP front, in-process SDK
transport) are thin adapters over an object that satisfies ``DataPlane``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from mesh.types import InferRequest, InferResponse, TaskSignature

__all__ = ["DataPlane"]


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
