"""A real edge in a process of its own, for tests that freeze one (SIGSTOP) under an SDK client.

``python -m tests.helpers_edge_proc SITE MODEL LOG`` serves the V2 HTTP front (``edge_agent.http_api``) over a real
ONNX data plane (``tests.helpers_dataplane.OnnxDataPlane``, the digits model at ``MODEL``) on a free loopback port,
prints its URL on one line, and serves until SIGTERM. Every query its data plane is handed is written to ``LOG`` (one
JSON line: request id, the budget left when it was handed over, and whether it was run or refused as past its
deadline), so a test can tell what a frozen edge did with the queries it found on waking.

:func:`start_edge` starts one from a test and reads its URL; :func:`stop_edge` ends it (SIGCONT first, in case).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from edge_agent.http_api import EdgeHttpServer
from mesh.errors import DeadlineExceeded
from mesh.types import InferRequest, InferResponse
from tests.helpers_dataplane import OnnxDataPlane

__all__ = ["read_log", "start_edge", "stop_edge"]

REPO_ROOT = Path(__file__).resolve().parents[1]


class _LoggingPlane(OnnxDataPlane):
    def __init__(self, site: str, model: Path, log: IO[str]) -> None:
        super().__init__(site, model)
        self.log = log

    async def infer(self, req: InferRequest) -> InferResponse:
        left = req.remaining_ms()
        try:
            resp = await super().infer(req)
        except DeadlineExceeded:
            self._note(req.request_id, left, "refused")
            raise
        self._note(req.request_id, left, "ran")
        return resp

    def _note(self, rid: str, left_ms: float, what: str) -> None:
        self.log.write(json.dumps({"id": rid, "left_ms": round(left_ms, 3), "what": what}) + "\n")
        self.log.flush()


async def _serve(site: str, model: Path, log_path: Path) -> None:
    with log_path.open("a", encoding="utf-8") as log:
        plane = _LoggingPlane(site, model, log)
        server = EdgeHttpServer(plane, "127.0.0.1", 0)
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print(server.url, flush=True)
        try:
            await stop.wait()
        finally:
            await server.stop()
            plane.close()


def start_edge(site: str, model: Path, log: Path) -> tuple[subprocess.Popen[str], str]:
    """Start an edge process; return it and its URL once it serves (the test's timeout bounds the wait)."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers_edge_proc", site, str(model), str(log)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the URL, once the server listens (or "" if it died)
    if not line.startswith("http"):
        stop_edge(proc)
        raise RuntimeError(f"edge {site} did not start (exit {proc.returncode}): {line!r}")
    return proc, line.strip()


def stop_edge(proc: subprocess.Popen[str], timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
    if proc.stdout is not None:
        proc.stdout.close()


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))
