"""Reading one field of a JSON object that came from etcd or a peer, as hostile input: present, of the type asked
(a boolean is never a number), in range. Every failure is a ``ProtocolError`` naming where, which field and why; the
record decoders (``mesh.jobspec``, ``mesh.buildspec``) share these so a value is checked one way everywhere."""

from __future__ import annotations

import math
from typing import Any

from mesh.errors import ProtocolError

__all__ = ["field", "integer", "number", "record"]


def field(d: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``d[name]``, which must be a ``kind`` (a bool only where ``kind`` is ``bool``)."""
    if name not in d:
        raise ProtocolError(f"{where}: missing {name!r}")
    v = d[name]
    if isinstance(v, bool) and kind is not bool:
        raise ProtocolError(f"{where}: {name!r} must not be a boolean")
    if not isinstance(v, kind):
        raise ProtocolError(f"{where}: {name!r} has the wrong type ({type(v).__name__})")
    return v


def number(d: dict[str, Any], name: str, where: str, lo: float, hi: float) -> float:
    """A finite number in [lo, hi]."""
    v = float(field(d, name, (int, float), where))
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ProtocolError(f"{where}: {name!r} = {v} is outside [{lo}, {hi}]")
    return v


def integer(d: dict[str, Any], name: str, where: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi]."""
    v = field(d, name, int, where)
    if not lo <= v <= hi:
        raise ProtocolError(f"{where}: {name!r} = {v} is outside [{lo}, {hi}]")
    return int(v)


def record(value: Any, where: str, schema: int) -> dict[str, Any]:
    """``value`` as a JSON object of the record schema ``schema`` (a newer writer's is refused, not guessed at)."""
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: not a JSON object ({type(value).__name__})")
    if value.get("schema") != schema:
        raise ProtocolError(f"{where}: schema {str(value.get('schema'))[:20]!r}, this reader knows {schema}")
    return value
