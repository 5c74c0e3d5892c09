"""Fixtures of the console's browser tests: Debian's Chromium driven by Playwright (never `playwright install`),
one real local mesh per module with the console on, over mutual TLS (the default), and a workload from every
tenant of the topology so the pages have something to show.

Skipped, with the reason, only where Chromium or Playwright is missing (`make test` installs Chromium through
scripts/sysdeps.sh).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from mesh.client import AsyncClient
from mesh.errors import MeshError
from tests.system.conftest import SMALL_TOPOLOGY, TASK
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions
from tiermesh.workload import DEFAULT_CLASSES
from variant_store.families.datasets import load_validation_npz

__all__ = ["CHROMIUM", "LAUNCH_ARGS", "chromium", "context_for", "run_queries"]

CHROMIUM = Path("/usr/lib/chromium/chromium")
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]


def _why_no_browser() -> str | None:
    if not CHROMIUM.exists():
        return f"Chromium not found at {CHROMIUM} (scripts/sysdeps.sh installs Debian's chromium as root)"
    try:
        import playwright.async_api  # noqa: F401
    except ImportError as exc:
        return f"playwright is not installed (the 'dev' extra): {exc}"
    return None


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Any]:
    """A headless Chromium (Debian's binary), closed with its Playwright driver on exit."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS, headless=True)
        try:
            yield browser
        finally:
            await browser.close()


async def context_for(browser: Any, url: str, cert: Path | None = None, key: Path | None = None) -> Any:
    """A browser context presenting ``cert``/``key`` to ``url``'s origin (none: no client certificate).
    The mesh CA is private, so the server certificate is accepted without a trust store."""
    origin = url.split("/", 3)
    certs = [{"origin": f"{origin[0]}//{origin[2]}", "certPath": str(cert), "keyPath": str(key)}] if cert else []
    return await browser.new_context(ignore_https_errors=True, client_certificates=certs,
                                     viewport={"width": 1360, "height": 860})


async def run_queries(mesh: LocalMesh, tenants: list[str], per_class: int = 4) -> int:
    """Queries of every SLO class from every tenant through every edge; returns how many were answered."""
    val = load_validation_npz()
    x = val.x[val.calib_count:]
    answered = 0
    for tenant in tenants:
        for url in mesh.edge_urls().values():
            async with AsyncClient(url, timeout=10.0, **mesh.tenant_files(tenant)) as client:  # type: ignore[arg-type]
                for i in range(per_class):
                    for cls in DEFAULT_CLASSES:
                        with contextlib.suppress(MeshError):
                            await client.infer(TASK, x[i % len(x)][None, :], latency_ms=cls.latency_ms,
                                               min_accuracy=cls.min_accuracy, prefer=cls.prefer)
                            answered += 1
    return answered


@pytest.fixture(scope="module")
def browser_available() -> None:
    why = _why_no_browser()
    if why is not None:
        pytest.skip(why)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def console_mesh(browser_available: None) -> AsyncIterator[LocalMesh]:
    """The small topology with the console, secured by default, after a workload from every tenant."""
    tmp = Path(tempfile.mkdtemp(prefix="tiermesh-console-"))
    mesh = LocalMesh(MeshOptions(topology=SMALL_TOPOLOGY, home=tmp, tls=True, console=True))
    try:
        await mesh.start()
        await mesh.wait_live()
        await mesh.wait_placed(timeout=60)
        await run_queries(mesh, mesh.tenants())
        await asyncio.sleep(2.5)  # two scrapes after the workload, so the console has seen its counters
        yield mesh
    finally:
        await mesh.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser(browser_available: None) -> AsyncIterator[Any]:
    async with chromium() as b:
        yield b
