"""Structured logging. Every record may carry ``tenant``, ``site``, ``request_id`` and ``task``;
``log.info("msg", extra=kv(tenant=..., site=...))`` puts them in the record, and the JSON
formatter emits them as fields."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["configure", "get_logger", "kv"]

_FIELDS = ("tenant", "site", "request_id", "task", "variant", "event", "reason")


def kv(**fields: Any) -> dict[str, Any]:
    """Extra fields for a log call; nested under one key so they never clash with LogRecord's."""
    return {"tm": fields}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "tm", {}) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "tm", {}) or {}
        tail = " ".join(f"{k}={v}" for k, v in fields.items())
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} {record.levelname[0]} {record.name}: {record.getMessage()}"
        if tail:
            line += f"  [{tail}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is *now*: a handler that kept the stream it was made with
    writes into a closed file once that stream is swapped out (test capture, daemonised runs)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure(level: str = "INFO", fmt: str = "text") -> None:
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("grpclib", "hpack", "asyncio", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
