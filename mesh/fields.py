"""Reading one field of a JSON object that came from etcd or a peer, as hostile input: present, of the type asked
(a boolean is never a number), in range. Every failure is a ``ProtocolError`` naming where, which field and why; the
record decoders (``mesh.jobspec``, ``mesh.buildspec``) share these so a value is checked one way everywhere."""

from __future__ import annotations

import math
from typing import Any

from mesh.errors import ProtocolError

__all__ = ["field", "integer", "number"]


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
