"""Structured logging. Every record may carry ``tenant``, ``site``, ``request_id`` and ``task``;
``log.info("msg", extra=kv(tenant=..., site=...))`` puts them in the record, and the JSON
formatter emits them as fields."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

__all__ = ["LogToFile", "configure", "get_logger", "kv"]

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


class LogToFile:
    """While entered, this process's log records and Python warnings (``warnings.warn``: a library's deprecation
    and quantization notices) go to ``path``, and to the screen as well only with ``echo``. ``tiermesh up`` runs
    etcd, the variant store's build and the scheduler in its own process: their records would otherwise mix into
    the summary it prints. With ``native`` (and without ``echo``) file descriptor 2 goes there too: C libraries
    write to it directly, not through Python (ONNX Runtime's own logger, TF Lite's ``INFO: Created TensorFlow
    Lite XNNPACK delegate``). On exit the handlers and the descriptor are as they were."""

    def __init__(self, path: Path, *, echo: bool = False, native: bool = False) -> None:
        self.path = path
        self.echo = echo
        self.native = native
        self._saved: list[logging.Handler] = []
        self._handler: logging.Handler | None = None
        self._showwarning: Any = None
        self._stderr_fd: int | None = None

    def __enter__(self) -> LogToFile:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = logging.FileHandler(self.path, encoding="utf-8")
        self._handler.setFormatter(TextFormatter())
        root = logging.getLogger()
        self._saved = list(root.handlers)
        root.handlers[:] = [*self._saved, self._handler] if self.echo else [self._handler]
        self._showwarning = warnings.showwarning
        logging.captureWarnings(True)  # to the "py.warnings" logger, so to the file
        if self.native and not self.echo:
            sys.stderr.flush()
            self._stderr_fd = os.dup(2)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, 2)
            os.close(fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stderr_fd is not None:
            sys.stderr.flush()
            os.dup2(self._stderr_fd, 2)
            os.close(self._stderr_fd)
            self._stderr_fd = None
        logging.captureWarnings(False)
        warnings.showwarning = self._showwarning
        logging.getLogger().handlers[:] = self._saved
        if self._handler is not None:
            self._handler.close()


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
