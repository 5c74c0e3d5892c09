"""W3C Trace Context (``traceparent``) for the mesh's decision traces.

A traced query carries ``00-<trace id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>`` from the door
that traced it to every hop (over ZeroMQ in the request header, ``mesh.zmq.protocol``); each hop that
passes it on names its own span as the parent. Only traced queries carry one: an untraced query pays
nothing. Pure functions, no I/O.
"""

from __future__ import annotations

import os
import re
from typing import Final

__all__ = ["TRACEPARENT_LEN", "child_traceparent", "new_traceparent", "parse_traceparent", "trace_id_of"]

TRACEPARENT_LEN: Final = 55
# version 00 only (lowercase hex, as the spec writes it); an all-zero trace or span id is invalid
_RE: Final = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_ZERO_TRACE: Final = "0" * 32
_ZERO_SPAN: Final = "0" * 16
SAMPLED: Final = "01"


def parse_traceparent(value: object) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of a valid version-00 ``traceparent``, else None."""
    if type(value) is not str or len(value) != TRACEPARENT_LEN:
        return None
    m = _RE.match(value)
    if m is None or m.group(1) == _ZERO_TRACE or m.group(2) == _ZERO_SPAN:
        return None
    return m.group(1), m.group(2), m.group(3)


def new_traceparent(trace_id: str | None = None) -> str:
    """A sampled ``traceparent`` with a fresh span id, in trace ``trace_id`` (a fresh one if None)."""
    return f"00-{trace_id or os.urandom(16).hex()}-{os.urandom(8).hex()}-{SAMPLED}"


def child_traceparent(parent: str) -> str:
    """The ``traceparent`` a hop sends on: the same trace and flags, its own span as the parent."""
    parsed = parse_traceparent(parent)
    if parsed is None:
        return new_traceparent()
    return f"00-{parsed[0]}-{os.urandom(8).hex()}-{parsed[2]}"


def trace_id_of(traceparent: str) -> str:
    """The trace id of a ``traceparent`` (empty if it is not valid)."""
    parsed = parse_traceparent(traceparent)
    return parsed[0] if parsed else ""
