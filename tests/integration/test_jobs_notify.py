"""Job notifications by webhook on real parts: the session etcd, a variant store with a data area, an agent door
(plain HTTP, ``--insecure``: the tenant is the header's) running the tiny digits MLP, a loopback HTTPS receiver whose
certificate a test CA signed (the tenant's ``webhook_ca`` in the topology), and the scheduler's
``core_scheduler.job_notify.JobNotifier`` over a real cluster view.

A job submitted with an allowed notify URL is told exactly once, even when the notifier runs round after round and a
second one (a new leader) runs after it; a URL outside the tenant's allow-list is refused at submission and nothing
is stored; a receiver that is down gets the bounded attempts and the job says ``notify_status: failed``; a redirect is
not followed; a prefix the operator removed after submission is not sent to."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from core_scheduler.job_notify import DELIVERY_HEADER, JobNotifier, NotifyConfig
from core_scheduler.state.jobs import JobBook
from core_scheduler.state.view import MeshView
from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.errors import RequestError
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.jobs import AsyncJobs
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.integration.test_quota_flood import TASK, _catalog
from tiermesh.cli.main import main as cli
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.data_area import DataArea
from variant_store.families.datasets import load_validation_npz
from variant_store.server import VariantStoreServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SMALL = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
SITE = "edge-fra-1"
HOOKS = Identity("site", "hooks")  # the receiver's server certificate (any kind the test CA issues will do)
ACME_LINE = "  - {name: acme, isolation: shared, quotas: {qps: 500, max_inflight: 64}}"
FAST = NotifyConfig(attempts=3, timeout_s=5.0, backoff_base_s=0.05, backoff_cap_s=0.2, claim_ttl_s=5.0)


class Receiver:
    """A loopback HTTPS webhook receiver: records every POST; ``/tiermesh/redirect`` answers 302,
    ``/tiermesh/slow`` after a second."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, str], Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.posts.append((request.path_qs, dict(request.headers), await request.json()))
        if request.path == "/tiermesh/slow":
            await asyncio.sleep(1.0)
        if request.path == "/tiermesh/redirect":
            raise web.HTTPFound("/tiermesh/elsewhere")
        return web.json_response({"ok": True})


@asynccontextmanager
async def _receiver(pki: LocalPki, rec: Receiver) -> AsyncIterator[int]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki.paths.cert(HOOKS), pki.paths.key(HOOKS))
    app = web.Application()
    app.router.add_post("/{tail:.*}", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


def _free_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there (the receiver that is down)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _topology(tmp: Path, hooks: list[str] | None) -> Path:
    text = SMALL.read_text()
    assert ACME_LINE in text
    if hooks is not None:
        listed = ", ".join(f'"{h}"' for h in hooks)
        text = text.replace(ACME_LINE, ACME_LINE[:-1] + f", webhooks: [{listed}], webhook_ca: hooks-ca.pem}}")
    path = tmp / ("topology-hooks.yaml" if hooks is not None else "topology-plain.yaml")
    path.write_text(text)
    return path


async def _until(what: str, ok: Any, limit: int = 200) -> None:
    for _ in range(limit):  # bounded: 10 s at most
        if ok():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def test_job_notifications_reach_allowed_receivers_once(store: Store, etcd_server: EmbeddedEtcd,
                                                              tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    pki = LocalPki.under(tmp_path / "pki")
    pki.init()
    pki.issue(HOOKS, addresses=["127.0.0.1"])
    (tmp_path / "hooks-ca.pem").write_bytes(pki.paths.ca_cert.read_bytes())
    rec = Receiver()
    x = load_validation_npz().x[:200]
    async with AsyncExitStack() as stack:
        port = await stack.enter_async_context(_receiver(pki, rec))
        down = _free_port()
        base, gone = f"https://127.0.0.1:{port}/tiermesh/", f"https://127.0.0.1:{down}/down/"
        await apply_topology(store, load_topology_file(_topology(tmp_path, [base, gone])))
        blobs = BlobStore(tmp_path / "blobs")
        await _catalog(store, blobs)
        await stack.enter_async_context(VariantStoreServer(blobs, Catalog(store), host="127.0.0.1",
                                                           data=DataArea(tmp_path / "data")))
        cfg = AgentConfig(site=SITE, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path / SITE,
                          lease_ttl_s=2.0, heartbeat_s=0.5, insecure=True)
        agent = await stack.enter_async_context(Agent(cfg))
        await _until("the store's announcement reaches the agent",
                     lambda: agent.host is not None and agent.host.blobs.store_url)
        view = await stack.enter_async_context(MeshView(store, "scheduler:test"))
        await _until("the view holds acme's webhooks",
                     lambda: "acme" in view.tenants and view.tenants["acme"].webhooks)
        acme = await stack.enter_async_context(AsyncJobs(agent.http_url, tenant="acme"))
        globex = await stack.enter_async_context(AsyncJobs(agent.http_url, tenant="globex"))

        # refused at the door, before anything is stored
        for who, url, why in ((acme, f"https://127.0.0.1:{port}/elsewhere/x", "not under a webhook prefix"),
                              (acme, f"https://127.0.0.1:{port}/tiermesh/../admin", "'..' segment"),
                              (acme, f"https://127.0.0.1:{port}/tiermesh/%2e%2e/admin", "encoded '.'"),
                              (acme, f"http://127.0.0.1:{port}/tiermesh/x", "https://"),
                              (acme, f"https://localhost:{port}/tiermesh/x", "not under a webhook prefix"),
                              (globex, f"{base}x", "tenant 'globex' has no webhook destinations")):
            with pytest.raises(RequestError) as refused:
                await who.submit(TASK, x, deadline_s=600, notify=url)
            assert "notify" in str(refused.value) and why in str(refused.value), url
        rows = tmp_path / "rows.npz"
        np.savez(rows, x=x)
        assert await asyncio.to_thread(cli, ["jobs", "submit", "--edge", agent.http_url, "--tenant", "acme", TASK,
                                             str(rows), "--notify", f"https://127.0.0.1:{port}/x"]) == 2
        assert "not under a webhook prefix" in capsys.readouterr().err
        book = JobBook(store)
        assert await book.list() == []

        ok = await acme.submit(TASK, x, deadline_s=600, chunk_rows=100, notify=f"{base}done?ref=7")
        assert ok.admitted["notify"] == f"{base}done?ref=7"
        dead = await acme.submit(TASK, x, deadline_s=600, chunk_rows=100, notify=f"{gone}x", fresh=True)
        moved = await acme.submit(TASK, x, deadline_s=600, chunk_rows=100, notify=f"{base}redirect", fresh=True)
        for job in (ok, dead, moved):
            st = await job.wait(poll_s=0.1, timeout=60)
            assert st["state"] == "done" and st["notify_status"] == "pending"

        # two senders at once (an old leader not yet aware it lost, and the new one): the claims decide who sends
        async with JobNotifier(store, lambda: view.tenants, "leader-1", FAST) as first, \
                JobNotifier(store, lambda: view.tenants, "leader-2", FAST) as second:
            started = await asyncio.gather(first.notify_once(), second.notify_once())
            assert 3 <= sum(started) <= 6
            await asyncio.gather(first.drain(), second.drain())
            for _ in range(3):  # later rounds find nothing due
                assert await first.notify_once() == 0 and await second.notify_once() == 0
            # delivered once; the receiver that is down: every attempt; the redirect: once
            assert first.sent + second.sent == 1 + FAST.attempts + 1
        async with JobNotifier(store, lambda: view.tenants, "leader-3", FAST) as later:  # a leader after them
            assert await later.notify_once() == 0
            assert later.sent == 0

        posts = [p for p in rec.posts if p[0] == "/tiermesh/done?ref=7"]
        assert len(posts) == 1  # exactly once
        _, headers, body = posts[0]
        assert headers[DELIVERY_HEADER] == ok.id and headers["Content-Type"] == "application/json"
        assert body == {"schema": 1, "event": "job.ended", "id": ok.id, "task": TASK, "tenant": "acme",
                        "state": "done", "rows": 200, "rows_done": 200, "error": "", "ended_at": body["ended_at"],
                        "result": f"/v2/models/{TASK}/jobs/{ok.id}/result"}
        assert [p[0] for p in rec.posts].count("/tiermesh/redirect") == 1 and len(rec.posts) == 2
        assert "/tiermesh/elsewhere" not in [p[0] for p in rec.posts]  # the redirect was not followed

        st = await ok.status()
        assert (st["notify"], st["notify_status"], st["notify_error"]) == (f"{base}done?ref=7", "delivered", "")
        st = await dead.status()
        assert st["notify_status"] == "failed" and f"{FAST.attempts} attempts failed" in st["notify_error"]
        st = await moved.status()
        assert st["notify_status"] == "failed" and "HTTP 302" in st["notify_error"]
        assert "redirects are not followed" in st["notify_error"]

        # a sender stopped mid-send (its leader died): its claim goes with its lease, and the next one sends again
        slow = await acme.submit(TASK, x, deadline_s=600, chunk_rows=100, notify=f"{base}slow", fresh=True)
        await slow.wait(poll_s=0.1, timeout=60)
        async with JobNotifier(store, lambda: view.tenants, "dies", FAST) as dies:
            assert await dies.notify_once() == 1
            await _until("the slow receiver is reached", lambda: len(rec.posts) == 3)
            assert (await slow.status())["notify_status"] == "sending"
        assert (await slow.status())["notify_status"] == "pending"
        async with JobNotifier(store, lambda: view.tenants, "next", FAST) as nxt:
            assert await nxt.notify_once() == 1
            await nxt.drain()
        assert (await slow.status())["notify_status"] == "delivered"
        assert [p[1][DELIVERY_HEADER] for p in rec.posts[2:]] == [slow.id, slow.id]  # "ish": the same delivery id

        # allowed at submission, removed by the operator before the job ended: checked again at send time
        late = await acme.submit(TASK, x, deadline_s=600, chunk_rows=100, notify=f"{base}late", fresh=True)
        await late.wait(poll_s=0.1, timeout=60)
        await apply_topology(store, load_topology_file(_topology(tmp_path, None)))
        await _until("the view loses acme's webhooks", lambda: not view.tenants["acme"].webhooks)
        async with JobNotifier(store, lambda: view.tenants, "leader-4", FAST) as third:
            assert await third.notify_once() == 1
            await third.drain()
            assert third.sent == 0
        st = await late.status()
        assert st["notify_status"] == "failed" and "not sent" in st["notify_error"]
        assert "no webhook destinations" in st["notify_error"]
        assert len(rec.posts) == 4  # nothing more reached the receiver
