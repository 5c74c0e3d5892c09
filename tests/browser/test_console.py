"""Issue 12, Done-when for the admin console, in headless Chromium against a real local mesh (small topology,
mutual TLS, console beside the scheduler): the map shows every site; SIGKILL of one site's agent turns it
unhealthy on the map within 5 s; the tenant page shows attainment for each tenant of the workload; a traced
request's hops and rejected candidates; a non-admin is refused. Each test saves a screenshot in its tmp dir.

One mesh and one browser for the module; the kill test runs last (it leaves a site dead).
"""

from __future__ import annotations

import importlib.util
import ssl
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from mesh.buildspec import BuildRequest, BuildState, VariantResult
from mesh.etcd.keys import build_key, build_state_key, cascade_key, version_key
from mesh.pki.identity import Identity
from tests.browser.conftest import context_for
from tests.system.conftest import TASK
from tiermesh.harness import LocalMesh
from variant_store.cascade_meta import CascadeMeta
from variant_store.families.datasets import load_validation_npz
from variant_store.versions import VersionInfo, VersionRecord

pytestmark = [pytest.mark.browser, pytest.mark.asyncio(loop_scope="module")]

# The agents' /metrics and decision traces are issue 12 items 1-2, built on another branch; until it is merged
# the console shows "no data" there, and these two tests cannot pass.
HAS_METRICS = importlib.util.find_spec("core_scheduler.metrics") is not None
needs_metrics = pytest.mark.xfail(not HAS_METRICS, reason="needs metrics branch", strict=False)


async def _admin_page(browser: Any, mesh: LocalMesh, fragment: str = "") -> tuple[Any, Any]:
    assert mesh.console is not None
    files = mesh.admin_files()
    ctx = await context_for(browser, mesh.console.url, files["cert"], files["key"])
    page = await ctx.new_page()
    resp = await page.goto(f"{mesh.console.url}/{fragment}")
    assert resp is not None and resp.status == 200, resp and await resp.text()
    return ctx, page


async def test_map_shows_every_site(console_mesh: LocalMesh, browser: Any, tmp_path: Path) -> None:
    sites = sorted(console_mesh.topology.sites)
    ctx, page = await _admin_page(browser, console_mesh)
    try:
        await page.wait_for_function(f"document.querySelectorAll('#sites g.site').length === {len(sites)}",
                                     timeout=15_000)
        shown = await page.eval_on_selector_all("#sites g.site", "els => els.map(e => e.dataset.site)")
        assert sorted(shown) == sites
        health = await page.eval_on_selector_all("#sites g.site", "els => els.map(e => e.dataset.health)")
        assert set(health) == {"up"}, dict(zip(shown, health, strict=True))
        links = await page.eval_on_selector_all("#links line", "els => els.map(e => e.dataset.link)")
        assert len(links) == len(console_mesh.topology.links)
        await page.wait_for_selector("#map path.land", timeout=10_000)  # the vendored world outline, no network
        assert await page.locator("#map path.land").count() == 1
        core = next(n for n, s in console_mesh.topology.sites.items() if s.tier == "core")
        await page.click(f"#sites g.site[data-site='{core}'] circle")
        await page.wait_for_selector(f"#site-panel h3:text('{core}')", timeout=5_000)
        assert await page.locator("#site-panel tr[data-variant]").count() >= 1  # what it has loaded
        await page.screenshot(path=str(tmp_path / "map.png"))
    finally:
        await ctx.close()


@needs_metrics
async def test_tenant_page_shows_attainment_for_each_tenant(console_mesh: LocalMesh, browser: Any,
                                                            tmp_path: Path) -> None:
    ctx, page = await _admin_page(browser, console_mesh, "#tenants")
    try:
        await page.wait_for_selector("#tab-tenants:not([hidden]) #tenant-table tr[data-tenant]", timeout=15_000)
        await page.screenshot(path=str(tmp_path / "tenants-start.png"))
        for tenant in console_mesh.tenants():  # every tenant the workload ran as
            await page.wait_for_selector(f"#tenant-table tr[data-tenant='{tenant}'] b[data-attainment]:not("
                                         f"[data-attainment=''])", timeout=20_000)
            value = await page.get_attribute(f"#tenant-table tr[data-tenant='{tenant}'] b[data-attainment]",
                                             "data-attainment")
            assert value is not None and 0.0 <= float(value) <= 1.0
        assert await page.locator("#tenants-nodata").is_hidden()
        await page.screenshot(path=str(tmp_path / "tenants.png"), full_page=True)
    finally:
        await ctx.close()


async def _traced_query(mesh: LocalMesh, tenant: str = "acme") -> str:
    """One query asking for its trace (OIP JSON, ``parameters.trace``), with an accuracy floor the small
    variants cannot meet, so some candidates are rejected; returns the request id."""
    val = load_validation_npz()
    row = np.asarray(val.x[-1], dtype=np.float32)
    files = mesh.tenant_files(tenant)
    ctx = ssl.create_default_context(cafile=str(files["ca"]))
    ctx.check_hostname = False
    ctx.load_cert_chain(str(files["cert"]), str(files["key"]))
    url = next(iter(sorted(mesh.edge_urls().values())))
    body = {"id": f"console-trace-{time.monotonic_ns()}",
            "inputs": [{"name": "x", "shape": [1, int(row.size)], "datatype": "FP32", "data": row.tolist()}],
            "parameters": {"latency_ms": 400, "min_accuracy": 0.98, "trace": True}}
    async with aiohttp.ClientSession() as session, \
            session.post(f"{url}/v2/models/{TASK}/infer", json=body, ssl=ctx) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
    return str(answer.get("id") or body["id"])


@needs_metrics
async def test_traced_request_shows_hops_and_rejected_candidates(console_mesh: LocalMesh, browser: Any,
                                                                 tmp_path: Path) -> None:
    request_id = await _traced_query(console_mesh)
    ctx, page = await _admin_page(browser, console_mesh, "#traces")
    try:
        await page.wait_for_selector("#tab-traces:not([hidden])", timeout=15_000)
        await page.fill("#trace-id", request_id)
        await page.click("#trace-form button")
        await page.wait_for_selector("#trace-result .hop", timeout=10_000)
        assert await page.locator("#trace-result .hop").count() >= 1
        assert await page.locator("#trace-result tr.chosen").count() >= 1
        rejected = page.locator("#trace-result tr[data-feasible='false']")
        assert await rejected.count() >= 1  # the variants below the 0.98 accuracy floor
        assert (await rejected.first.locator("td").last.inner_text()).strip()  # and why each was rejected
        await page.screenshot(path=str(tmp_path / "trace.png"), full_page=True)
    finally:
        await ctx.close()


async def test_builds_and_cascades_tabs_render_rows_from_the_api(console_mesh: LocalMesh, browser: Any,
                                                                  tmp_path: Path) -> None:
    """Issues 34 and 33 in the page: a tenant's build with its measured variant, a catalogued cascade, a task's
    version record and a broken cascade entry (under a task nothing serves, so routing never sees them); the keys
    go afterwards."""
    store = console_mesh.store
    assert store is not None
    bid, now = uuid.uuid4().hex, time.time()
    req = BuildRequest(build_id=bid, tenant="acme", task="console-check", family="console-fam", model_digest="a" * 64,
                       model_bytes=100, validation_digest="b" * 64, validation_bytes=100, rows=10, door="browser",
                       created=now)
    res = VariantResult("console-fam.onnx.int8", "onnx", "int8", 0.9, 2048, {"cpu": {1: 1.25}})
    cascade = CascadeMeta(task="console-check", cascade_id="cc-1", stages=("a.onnx.int8", "b.onnx.fp32"),
                          rule="margin", thresholds=(0.5,), accuracy=0.95, escalation=(0.3,), target_accuracy=0.94,
                          calibration_rows=10, heldout_rows=10)
    keys = [build_key("acme", bid), build_state_key(bid), cascade_key("console-check", "cc-1"),
            cascade_key("console-check", "cc-bad"), version_key("console-check")]
    await store.put(keys[0], req.to_json())
    await store.put(keys[1], BuildState(bid, "acme", "done", stage="done", progress=1.0, variants=(res,),
                                        updated=now).to_json())
    await store.put(keys[2], cascade.to_json())
    await store.put(keys[3], {"schema": 1, "task": "console-check"})
    await store.put(keys[4], VersionRecord("console-check", "acme", active=1,
                                           versions={1: VersionInfo("console-fam", "active", 0.9)}).to_json())
    ctx, page = await _admin_page(browser, console_mesh, "#builds")
    try:
        row = f"#tab-builds:not([hidden]) #build-table tr[data-build='{bid}']"
        await page.wait_for_selector(f"{row} li[data-variant='console-fam.onnx.int8']", timeout=15_000)
        assert "done" in await page.inner_text(f"{row} td:nth-child(5)")
        assert "1.25 ms" in await page.inner_text(f"{row} li[data-variant]")
        await page.screenshot(path=str(tmp_path / "builds.png"), full_page=True)
        await page.click("#tabs a[data-tab='cascades']")
        await page.wait_for_selector("#tab-cascades:not([hidden]) #cascade-table tr[data-cascade='cc-1']",
                                     timeout=15_000)
        await page.wait_for_selector("#cascade-broken:not([hidden]) li[data-key$='cascades/console-check/cc-bad']",
                                     timeout=5_000)
        await page.screenshot(path=str(tmp_path / "cascades.png"), full_page=True)
        await page.click("#tabs a[data-tab='versions']")  # issue 34: each version's state, share and queries
        vrow = "#tab-versions:not([hidden]) #version-table tr[data-task='console-check'][data-version='1']"
        await page.wait_for_selector(vrow, timeout=15_000)
        assert "active" in await page.inner_text(vrow)
    finally:
        await ctx.close()
        for key in keys:
            await store.delete(key)


async def test_non_admin_is_refused(console_mesh: LocalMesh, browser: Any, tmp_path: Path) -> None:
    assert console_mesh.console is not None and console_mesh.pki is not None
    url = console_mesh.console.url
    paths = console_mesh.pki.paths
    for who in (Identity("tenant", "acme"), Identity("site", sorted(console_mesh.topology.sites)[0])):
        ctx = await context_for(browser, url, paths.cert(who), paths.key(who))
        try:
            page = await ctx.new_page()
            resp = await page.goto(f"{url}/")
            assert resp is not None and resp.status == 403, (who, resp and resp.status)
            assert "403" in await page.inner_text("#refused")
            api = await page.request.get(f"{url}/api/state")
            assert api.status == 403  # the data too, not just the page
            await page.screenshot(path=str(tmp_path / f"refused-{who.kind}.png"))
        finally:
            await ctx.close()
    ctx = await context_for(browser, url)  # no client certificate: no TLS session, no page
    try:
        page = await ctx.new_page()
        with pytest.raises(Exception, match=r"ERR_|net::|closed|reset|certificate"):
            await page.goto(f"{url}/", timeout=10_000)
        # no screenshot here: what is on screen is Chromium's own error page, and capturing it
        # after a failed navigation is refused now and then ("Unable to capture screenshot")
    finally:
        await ctx.close()


async def test_sigkill_turns_the_site_unhealthy_within_5s(console_mesh: LocalMesh, browser: Any,
                                                          tmp_path: Path) -> None:
    """Runs last in the module: the site stays dead."""
    victim = sorted(console_mesh.edge_urls())[-1]
    ctx, page = await _admin_page(browser, console_mesh)
    selector = f"#sites g.site[data-site='{victim}']"
    try:
        await page.wait_for_selector(f"{selector}[data-health='up']", timeout=15_000)
        await console_mesh.kill_site(victim)  # SIGKILL: no goodbye, its lease must run out
        killed = time.monotonic()
        await page.wait_for_function(
            f"['unreachable', 'down'].includes(document.querySelector(\"{selector}\").dataset.health)",
            timeout=5_000)
        took = time.monotonic() - killed
        await page.screenshot(path=str(tmp_path / "killed.png"))
        assert took <= 5.0, took
        others = await page.eval_on_selector_all("#sites g.site", "els => els.filter(e => e.dataset.health "
                                                                   "=== 'up').map(e => e.dataset.site)")
        assert victim not in others and len(others) == len(console_mesh.topology.sites) - 1
    finally:
        await ctx.close()
