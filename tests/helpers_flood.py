"""An edge front (REST or gRPC) in a process of its own, its descriptors limited as a container's are, and a flood
of idle connections against it: for the connection guard's tests (:mod:`edge_agent.conn_guard`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.helpers.mtls_edge import SITE
from tests.helpers_dataplane import digits_model

__all__ = ["descriptors", "flood", "front_process"]

REPO = Path(__file__).resolve().parents[1]
_SERVE = """
import asyncio, resource, sys
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, ({files}, hard))
from edge_agent.grpc_api import EdgeGrpcServer
from edge_agent.http_api import EdgeHttpServer
from edge_agent.mtls import EdgeTls
from tests.helpers_dataplane import OnnxDataPlane

async def main():
    dp = OnnxDataPlane({site!r}, {model!r}, accuracy=0.96)
    tls = EdgeTls.under({home!r}, {site!r}) if {tls!r} else None
    grpc = {grpc!r}
    if tls is not None and grpc:  # the REST front starts and stops its TLS side; the gRPC one is given it started
        await tls.start()
    front = EdgeGrpcServer if grpc else EdgeHttpServer
    async with front(dp, "127.0.0.1", tls=tls) as srv:
        print(srv.address if grpc else srv.url, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    if tls is not None and grpc:
        await tls.stop()
    dp.close()

asyncio.run(main())
"""


@contextlib.contextmanager
def front_process(tmp_path: Path, *, tls: bool, grpc: bool, files: int) -> Iterator[tuple[str, int]]:
    """An edge's REST (or ``grpc``) front over the digits model in its own process with ``files`` descriptors;
    yields its URL (gRPC: its ``host:port``) and pid; stopped (stdin closed, killed if need be) even on failure."""
    model = digits_model(tmp_path)
    code = _SERVE.format(files=files, site=SITE.name, model=str(model), home=str(tmp_path), tls=tls, grpc=grpc)
    with (tmp_path / "edge.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            assert proc.stdout is not None
            where = proc.stdout.readline().decode().strip()
            assert where.startswith(("127.0.0.1:", "http")), (tmp_path / "edge.log").read_text()[-2000:]
            yield where, proc.pid
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def flood(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections to the edge that send nothing (connects left to finish in the kernel)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    return socks


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
