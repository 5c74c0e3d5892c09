"""``tiermesh console-screenshot``: start a local mesh with its console, drive a workload through it, and save a
PNG of a console page taken in headless Chromium (the README's picture: ``--out docs/console.png``).

Needs Debian's ``chromium`` (``scripts/sysdeps.sh``) and the ``playwright`` package of the ``dev`` extra; it
never runs ``playwright install`` and needs no network.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from mesh.errors import ConfigError
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions
from tiermesh.workload import run_workload

__all__ = ["CHROMIUM", "register", "screenshot"]

CHROMIUM = Path("/usr/lib/chromium/chromium")
TABS = ("map", "placements", "tenants", "traces", "topology")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("console-screenshot", help="screenshot the admin console of a local mesh under load",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="PNG file to write")
    p.add_argument("--topology", type=Path, default=Path("examples/topology.yaml"), help="topology YAML")
    p.add_argument("--seconds", type=float, default=20.0, help="workload before the picture (default %(default)s)")
    p.add_argument("--qps", type=float, default=30.0, help="offered load of the workload (queries/s)")
    p.add_argument("--tab", choices=TABS, default="map", help="which page (default %(default)s)")
    p.add_argument("--select", default=None, metavar="SITE", help="on the map, open this site's panel")
    p.add_argument("--chromium", type=Path, default=CHROMIUM, help="Chromium binary (default %(default)s)")
    p.set_defaults(func=_run)


def _check_chromium(path: Path) -> None:
    if not path.exists():
        raise ConfigError(f"no Chromium at {path} (scripts/sysdeps.sh installs Debian's chromium)")


async def screenshot(mesh: LocalMesh, out: Path, *, tab: str = "map", select: str | None = None,
                     chromium: Path = CHROMIUM, width: int = 1360, height: int = 820) -> Path:
    """Open the console of a running ``mesh`` as its admin and save ``tab`` to ``out``."""
    try:
        from playwright.async_api import async_playwright
    except ImportError as exc:
        raise ConfigError(f"console-screenshot needs playwright (pip install -e '.[dev]'): {exc}") from exc
    _check_chromium(chromium)
    if mesh.console is None:
        raise ConfigError("this mesh runs no console")
    url = mesh.console.url
    certs: list[Any] = []
    if mesh.pki is not None:
        files = mesh.admin_files()
        certs = [{"origin": url, "certPath": str(files["cert"]), "keyPath": str(files["key"])}]
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(chromium), headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            ctx = await browser.new_context(ignore_https_errors=True, client_certificates=certs,
                                            viewport={"width": width, "height": height})
            page = await ctx.new_page()
            await page.goto(f"{mesh.console.login_url}#{tab}")
            await page.wait_for_selector("body[data-version]", state="attached", timeout=20_000)  # a first snapshot
            if tab == "map" and select:
                await page.click(f"#sites g.site[data-site='{select}'] circle")
            await page.wait_for_timeout(2500)  # a few snapshots, so rates and charts have points
            out.parent.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(out))
        finally:
            await browser.close()
    return out


async def _run(args: argparse.Namespace) -> int:
    if not args.topology.exists():
        raise ConfigError(f"topology file {args.topology} not found (run from the repository root or pass --topology)")
    from variant_store.families.datasets import load_validation_npz

    val = load_validation_npz()
    x, y = val.x[val.calib_count:], val.y[val.calib_count:]
    with tempfile.TemporaryDirectory(prefix="tiermesh-shot-", ignore_cleanup_errors=True) as tmp:
        mesh = LocalMesh(MeshOptions(topology=args.topology, home=Path(tmp), tls=True, console=True))
        await mesh.start()
        try:
            await mesh.wait_placed(timeout=60)
            work = asyncio.create_task(run_workload(mesh.edge_urls(), x, y, duration_s=args.seconds + 10,
                                                    qps=args.qps, credentials=mesh.tenant_files))
            try:
                await asyncio.sleep(args.seconds)
                path = await screenshot(mesh, args.out, tab=args.tab, select=args.select, chromium=args.chromium)
            finally:
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        finally:
            await mesh.stop()
    print(f"console screenshot written to {path}")
    return 0
