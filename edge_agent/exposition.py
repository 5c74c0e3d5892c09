"""Prometheus' text exposition format (version 0.0.4), written by hand: what an agent's ``/metrics`` answers.

Why not prometheus_client: an agent keeps its own counters and histogram buckets (:mod:`edge_agent.metrics`) and
needs only their text at scrape time, and the library with its registry held about 1.3 MiB of an idle edge
agent (issue 17). The scheduler, with live Counter and Histogram objects, keeps using it.

Each function returns one family: ``# HELP`` and ``# TYPE`` lines, then its samples. Names follow the format:
a counter ``x`` is written ``x_total``; a histogram ``h`` as cumulative ``h_bucket{le=...}`` lines ending at
``+Inf``, then ``h_count`` and ``h_sum``. Label values are escaped (backslash, double quote, newline).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["CONTENT_TYPE", "counter", "escape", "gauge", "histogram", "number"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Rows = Iterable[tuple[Sequence[str], float]]


def escape(value: str) -> str:
    """A label value as the format quotes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def number(value: float) -> str:
    """A sample value: ``+Inf``, ``-Inf``, ``NaN`` or Python's shortest repr of the float."""
    v = float(value)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return "NaN" if math.isnan(v) else repr(v)


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    if len(names) != len(values):
        raise ValueError(f"labels {list(names)} given values {list(values)}")
    return "{" + ",".join(f'{n}="{escape(v)}"' for n, v in zip(names, values, strict=True)) + "}"


def _head(name: str, kind: str, doc: str) -> list[str]:
    text = doc.replace("\\", "\\\\").replace("\n", "\\n")
    return [f"# HELP {name} {text}\n", f"# TYPE {name} {kind}\n"]


def counter(name: str, doc: str, labels: Sequence[str], rows: Rows) -> str:
    """A counter family: ``rows`` are (label values, count)."""
    full = name if name.endswith("_total") else name + "_total"
    out = _head(full, "counter", doc)
    out += [f"{full}{_labels(labels, values)} {number(v)}\n" for values, v in rows]
    return "".join(out)


def gauge(name: str, doc: str, labels: Sequence[str], rows: Rows) -> str:
    """A gauge family: ``rows`` are (label values, value); a gauge without labels has one row, ``((), value)``."""
    out = _head(name, "gauge", doc)
    out += [f"{name}{_labels(labels, values)} {number(v)}\n" for values, v in rows]
    return "".join(out)


def histogram(name: str, doc: str, labels: Sequence[str],
              rows: Iterable[tuple[Sequence[str], Sequence[tuple[str, float]], float]]) -> str:
    """A histogram family: ``rows`` are (label values, cumulative (le, count) ending at ``+Inf``, sum)."""
    out = _head(name, "histogram", doc)
    names = (*labels, "le")
    for values, buckets, total in rows:
        if not buckets or buckets[-1][0] != "+Inf":
            raise ValueError(f"{name}: buckets must end at +Inf")
        out += [f"{name}_bucket{_labels(names, (*values, le))} {number(n)}\n" for le, n in buckets]
        out.append(f"{name}_count{_labels(labels, values)} {number(buckets[-1][1])}\n")
        out.append(f"{name}_sum{_labels(labels, values)} {number(total)}\n")
    return "".join(out)
