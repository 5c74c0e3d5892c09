"""Prometheus text exposition format (version 0.0.4) -> samples: what the console reads from each agent's
``/metrics``.

A deliberately small reader: ``# HELP`` / ``# TYPE`` and other comments are skipped, each sample line is
``name{label="value",...} value [timestamp]`` with the format's escapes (``\\\\``, ``\\"``, ``\\n``) in label
values, and values may be ``+Inf`` / ``-Inf`` / ``NaN``. Histogram series arrive as their ``_bucket`` /
``_sum`` / ``_count`` samples (:mod:`console.digest` puts them back together). A line that is not a sample
raises ``ValueError`` naming the line: a scrape either parses whole or is reported as failed, never half read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Sample", "parse_text"]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,)?')
_UNESCAPE = re.compile(r"\\(.)")
_VALUES = {"+inf": math.inf, "inf": math.inf, "-inf": -math.inf, "nan": math.nan}


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _unescape(raw: str) -> str:
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), raw)


def _value(text: str, lineno: int) -> float:
    low = text.lower()
    if low in _VALUES:
        return _VALUES[low]
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"line {lineno}: {text!r} is not a sample value") from None


def _labels(line: str, start: int, lineno: int) -> tuple[dict[str, str], int]:
    labels: dict[str, str] = {}
    pos = start
    while True:
        if line[pos:].lstrip().startswith("}"):
            return labels, line.index("}", pos) + 1
        m = _LABEL.match(line, pos)
        if m is None:
            raise ValueError(f"line {lineno}: malformed labels in {line!r}")
        labels[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
        if m.group(3) is None:
            rest = line[pos:].lstrip()
            if not rest.startswith("}"):
                raise ValueError(f"line {lineno}: labels not closed in {line!r}")
            return labels, line.index("}", pos) + 1


def parse_text(text: str) -> list[Sample]:
    """Every sample of an exposition, in order. ``ValueError`` on the first malformed line."""
    out: list[Sample] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME.match(line)
        if m is None:
            raise ValueError(f"line {lineno}: no metric name in {line!r}")
        pos = m.end()
        labels: dict[str, str] = {}
        if pos < len(line) and line[pos] == "{":
            labels, pos = _labels(line, pos + 1, lineno)
        fields = line[pos:].split()
        if len(fields) not in (1, 2):
            raise ValueError(f"line {lineno}: expected a value (and an optional timestamp) in {line!r}")
        out.append(Sample(m.group(0), labels, _value(fields[0], lineno)))
    return out
