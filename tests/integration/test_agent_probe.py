"""``tiermesh agent --site S --probe``: the Kubernetes readiness probe of a secured agent. It asks the edge's
``/v2/health/ready`` over mutual TLS with the site's own certificate, on loopback with a real PKI and a real
ONNX data plane, and says ready only when the agent is ready *and* proves to be that site."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from edge_agent.http_api import EdgeHttpServer
from edge_agent.mtls import EdgeTls
from mesh.errors import ConfigError
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.helpers.mtls_edge import SITE, make_pki
from tests.helpers_dataplane import OnnxDataPlane, digits_plane
from tiermesh import deploy
from tiermesh.cli.agent import probe_ready

pytestmark = pytest.mark.integration

OTHER = Identity("site", "edge-other")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnnxDataPlane]:
    with digits_plane(tmp_path_factory.mktemp("model"), SITE.name) as plane:
        yield plane


@pytest.fixture
def pki(tmp_path: Path) -> LocalPki:
    pki = make_pki(tmp_path)
    pki.issue(OTHER, addresses=["127.0.0.1"])
    return pki


@pytest.fixture
async def edge(pki: LocalPki, dp: OnnxDataPlane, tmp_path: Path) -> AsyncIterator[EdgeHttpServer]:
    dp.is_ready = True
    async with EdgeHttpServer(dp, "127.0.0.1", 0, tls=EdgeTls.under(tmp_path, SITE.name)) as server:
        yield server


async def _probe(home: Path, site: str, port: int) -> tuple[bool, str]:
    return await asyncio.to_thread(probe_ready, home, site, port, timeout_s=10)


async def test_ready_agent_is_ready_and_not_ready_one_is_not(edge: EdgeHttpServer, dp: OnnxDataPlane,
                                                              tmp_path: Path) -> None:
    ok, why = await _probe(tmp_path, SITE.name, edge.port)
    assert ok, why
    dp.is_ready = False
    ok, why = await _probe(tmp_path, SITE.name, edge.port)
    assert not ok and why.startswith("503"), why


async def test_another_sites_server_is_not_this_agent(edge: EdgeHttpServer, tmp_path: Path) -> None:
    # edge-other's certificate is valid and the endpoint admits it, but the server is edge-test: not ready
    ok, why = await _probe(tmp_path, OTHER.name, edge.port)
    assert not ok and f"is not {OTHER.uri}" in why, why


async def test_nothing_listening_is_not_ready(edge: EdgeHttpServer, tmp_path: Path) -> None:
    port = edge.port
    await edge.stop()
    ok, why = await _probe(tmp_path, SITE.name, port)
    assert not ok and str(port) in why, why


def test_missing_credentials_and_port_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="credentials"):
        probe_ready(tmp_path, SITE.name, 8000)
    with pytest.raises(ConfigError, match="--http-port"):
        probe_ready(tmp_path, SITE.name, 0)


async def test_command_line_exit_codes(edge: EdgeHttpServer, dp: OnnxDataPlane, tmp_path: Path) -> None:
    """What the manifests run: exit 0 when ready, 1 when not (the etcd settings are not needed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    async def run() -> tuple[int, bytes]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tiermesh", "agent", "--site", SITE.name, "--home", str(tmp_path),
            "--http-port", str(edge.port), "--probe", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode is not None
        return proc.returncode, out

    rc, out = await run()
    assert rc == 0, out
    assert b"ready" in out
    dp.is_ready = False
    rc, out = await run()
    assert rc == 1 and b"not ready" in out, out


def _project(pki: LocalPki, home: Path) -> None:
    """Lay out under ``home`` what the agent pod's projected volume holds: those files of ``pki`` only."""
    for path in deploy.agent_pki_files(SITE.name):
        rel = path.relative_to(deploy.AGENT_PKI.root)
        (home / "pki" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pki.paths.root / rel, home / "pki" / rel)


async def test_the_files_an_agent_pod_mounts_are_enough(pki: LocalPki, dp: OnnxDataPlane, tmp_path: Path) -> None:
    """A home holding only what the Kubernetes manifests project into an agent's pod (deploy.agent_pki_files,
    taken from a real `tiermesh pki` tree) serves HTTPS and answers its own readiness probe."""
    dp.is_ready = True
    home = tmp_path / "pod-home"
    _project(pki, home)
    async with EdgeHttpServer(dp, "127.0.0.1", 0, tls=EdgeTls.under(home, SITE.name)) as server:
        ok, why = await _probe(home, SITE.name, server.port)
    assert ok, why
