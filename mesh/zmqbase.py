"""What both ends of :mod:`mesh.transport` share: the socket-security hook and the lifecycle state."""

from __future__ import annotations

import enum
from typing import Any, Protocol

import zmq

__all__ = ["LifecycleState", "SocketSecurity"]


class SocketSecurity(Protocol):
    """Where CURVE keys and the ZAP domain are applied to a socket before bind / connect."""

    def apply_server(self, sock: zmq.Socket[Any]) -> None: ...

    def apply_client(self, sock: zmq.Socket[Any], server_key: bytes | None) -> None: ...


class LifecycleState(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"
