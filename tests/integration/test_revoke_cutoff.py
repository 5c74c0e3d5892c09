"""A revoked identity cut off a real etcd (TLS, client-certificate auth, RBAC, ``--client-crl-file``) without
waiting for its connections to end: ``tiermesh pki revoke`` with a root admin's certificate takes its roles and a
site's heartbeat lease (:func:`mesh.etcd.rbac.cut_off`), and ``tiermesh pki follow-crl`` beside etcd (with etcd's
own certificate, allowed to read ``pki/crl`` only) rewrites etcd's list and resets the connections it holds, so
its open watch stream and lease keep-alives end too. Measured times are printed (``pytest -s``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from mesh.errors import StoreError, StoreUnavailable
from mesh.etcd.channels import StorePermissionDenied
from mesh.etcd.keys import PKI_CRL, live_key, site_cert_key, site_key
from mesh.etcd.rbac import apply, cut_off, plan
from mesh.etcd.server import EmbeddedEtcd, ServerTLS
from mesh.etcd.store import Store
from mesh.etcd.watch import WatchEvent
from mesh.pki.crl import RevocationList
from mesh.pki.files import write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.helpers.waiting import eventually
from tiermesh.cli.main import EXIT_OK, main

pytestmark = pytest.mark.integration
PREFIX = "/cut/"
ETCD, EDGE, OTHER = Identity("etcd", "etcd"), Identity("site", "edge-1"), Identity("site", "edge-2")
SCHED, ROOT, OP, ACME = Identity("scheduler", "s1"), Identity("admin", "root-op"), Identity("admin", "op"), \
    Identity("tenant", "acme")


@dataclass
class Mesh:
    srv: EmbeddedEtcd
    pki: LocalPki
    home: Path
    crl_file: Path

    def connect(self, who: Identity, probe: str | None = None) -> asyncio.Future[Store]:
        return asyncio.ensure_future(Store.connect(self.srv.url, PREFIX, ca=self.pki.paths.ca_cert,
                                                   cert=self.pki.paths.cert(who), key=self.pki.paths.key(who),
                                                   timeout=3.0, probe=probe))

    def etcd_args(self, who: Identity) -> list[str]:
        return ["--etcd", self.srv.url, "--etcd-ca", str(self.pki.paths.ca_cert), "--etcd-cert",
                str(self.pki.paths.cert(who)), "--etcd-key", str(self.pki.paths.key(who)), "--prefix", PREFIX]

    def revoke(self, who: Identity, *, as_: Identity = ROOT) -> int:
        return main(["pki", "revoke", "--home", str(self.home), f"--{who.kind}", who.name, *self.etcd_args(as_)])


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(ETCD, addresses=["127.0.0.1", "localhost"])
    for who in (EDGE, OTHER, SCHED, ROOT, OP, ACME):
        pki.issue(who)
    crl_file = tmp_path / "etcd-crl.pem"  # etcd's own copy, kept by the follower
    write_file(crl_file, pki.paths.crl.read_bytes())
    srv = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True,
                       tls=ServerTLS(pki.paths.cert(ETCD), pki.paths.key(ETCD), pki.paths.ca_cert, crl_file=crl_file))
    m = Mesh(srv, pki, tmp_path, crl_file)
    try:
        await srv.start()
        async with await m.connect(ROOT) as root:
            await root.put(site_key("edge-1"), {"name": "edge-1"})
            await apply(root, plan(PREFIX, sites=["edge-1", "edge-2"], schedulers=["s1"], admins=["op"],
                                   root_admins=["root-op"], crl_followers=[ETCD]))
        yield m
    finally:
        await srv.stop()


@dataclass
class Holder:
    """An identity with an open connection: a heartbeat under a lease, and a watch on ``topology/``."""

    store: Store
    events: list[tuple[float, WatchEvent]]
    task: asyncio.Task[None]

    @classmethod
    async def open(cls, m: Mesh, who: Identity) -> Holder:
        store = await m.connect(who)
        events: list[tuple[float, WatchEvent]] = []

        async def watch() -> None:
            with contextlib.suppress(StoreError):
                async with store.watch_prefix("topology/") as w:
                    async for ev in w:
                        events.append((time.monotonic(), ev))

        holder = cls(store, events, asyncio.create_task(watch()))
        await asyncio.sleep(0.3)  # the watch is created
        return holder

    def saw(self, key: str) -> bool:
        return any(ev.key == key for _, ev in self.events)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.store.close()


async def test_revoke_cuts_a_site_off_its_open_connection_at_once(mesh: Mesh,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    edge = await Holder.open(mesh, EDGE)
    lease = await edge.store.lease(6)  # kept alive every 2 s: only the revoke ends it
    await edge.store.put(live_key("edge-1"), {"ok": 1}, lease=lease)
    try:
        assert await asyncio.to_thread(mesh.revoke, EDGE) == EXIT_OK
        revoked = time.monotonic()
        out = capsys.readouterr()
        assert "etcd user site:edge-1: took away tiermesh-site:edge-1" in out.out
        assert f"revoked lease {lease.id:x} of live/edge-1" in out.out
        assert "tiermesh etcd-rbac` gives its roles back" in out.err
        # the connection it holds: every request refused now, not when the connection ends
        with pytest.raises(StorePermissionDenied):
            await edge.store.get(site_key("edge-1"))
        with pytest.raises(StorePermissionDenied):
            await edge.store.put(live_key("edge-1"), {"ok": 2})
        print(f"\nunary request on the open connection refused {time.monotonic() - revoked:.3f} s after revoke")
        async with await mesh.connect(SCHED) as sched:
            assert await sched.get(live_key("edge-1")) is None  # its heartbeat is gone with its lease
            await eventually(lambda: _lost(lease), 5, "the site's lease keep-alive finds its lease gone")
            fresh = await edge.store.lease(5)  # a fresh lease is granted, but the heartbeat cannot come back
            with pytest.raises(StorePermissionDenied):
                await edge.store.put(live_key("edge-1"), {"ok": 3}, lease=fresh)
            assert await sched.get(live_key("edge-1")) is None
            # what roles alone do not end (etcd 3.5.1): the open watch stream still delivers. The follower's reset
            # ends it (test below)
            async with await mesh.connect(ROOT) as root:
                await root.put("topology/after", {"v": 1})
            await asyncio.sleep(1.0)
            print(f"watch stream after the roles were taken: still delivering = {edge.saw('topology/after')}")
        # idempotent: cut off again, nothing left to take
        async with await mesh.connect(ROOT) as root:
            again = await cut_off(root, EDGE)
            assert again.roles == () and again.lease is None and again.user == "site:edge-1"
            # a tenant has no etcd user; a root admin cutting off someone not in the plan is fine too
            assert (await cut_off(root, ACME)).user is None
            # issued again: etcd-rbac gives the roles back
            await apply(root, plan(PREFIX, sites=["edge-1", "edge-2"], root_admins=["root-op"]))
        await edge.store.get(site_key("edge-1"))
    finally:
        await edge.close()


async def test_cut_off_goes_on_through_replies_lost_to_a_connection_reset(mesh: Mesh,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A revocation makes the follower beside etcd reset every open connection, the operator's own among them,
    often while the cut is under way (a CI run lost a lease revoke's reply that way). Each step is sent again; one
    that etcd carried out before the reply was lost is reported as done."""
    edge = await Holder.open(mesh, EDGE)
    lease = await edge.store.lease(6)
    await edge.store.put(live_key("edge-1"), {"ok": 1}, lease=lease)
    try:
        async with await mesh.connect(ROOT) as root:
            real_revoke, real_get, lost = root.revoke_lease, root.get, []

            async def revoke_then_lose(lease_id: int) -> bool:
                done = await real_revoke(lease_id)  # etcd did it ...
                if "lease" in lost:
                    return done  # sent again: etcd no longer knows the lease (False)
                lost.append("lease")
                raise StoreUnavailable("lease revoke [test]: connection to etcd lost")  # ... the reply never came

            async def lose_first_get(key: str) -> object:
                if "get" not in lost:
                    lost.append("get")
                    raise StoreUnavailable("get [test]: connection to etcd lost")
                return await real_get(key)

            monkeypatch.setattr(root, "revoke_lease", revoke_then_lose)
            monkeypatch.setattr(root, "get", lose_first_get)
            done = await cut_off(root, EDGE)
            assert lost == ["get", "lease"]
            assert done.lease == lease.id and done.roles == ("tiermesh-site:edge-1",)
            monkeypatch.undo()
            assert await root.get(live_key("edge-1")) is None
            with pytest.raises(StorePermissionDenied):
                await edge.store.get(site_key("edge-1"))

            async def always_lost(_: int) -> bool:
                raise StoreUnavailable("lease revoke [test]: etcd is down")

            monkeypatch.setattr(root, "revoke_lease", always_lost)
            await apply(root, plan(PREFIX, sites=["edge-1", "edge-2"], root_admins=["root-op"]))
            again = await edge.store.lease(6)
            await edge.store.put(live_key("edge-1"), {"ok": 2}, lease=again)
            with pytest.raises(StoreUnavailable):  # an etcd that stays unreachable is reported, after a bounded retry
                await cut_off(root, EDGE)
    finally:
        await edge.close()


async def _lost(lease: object) -> bool:
    return bool(lease.lost.is_set())  # type: ignore[attr-defined]


async def test_only_a_root_admin_cuts_off_and_an_operator_is_told(mesh: Mesh,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    async with await mesh.connect(OP) as op:
        with pytest.raises(StorePermissionDenied):
            await cut_off(op, EDGE)
    # `pki revoke` as an operator (not root): the list is published, the cut-off refused and said so
    assert await asyncio.to_thread(mesh.revoke, OTHER, as_=OP) == EXIT_OK
    err = capsys.readouterr().err
    assert "published at etcd pki/crl" in err and "not cut off in etcd" in err
    async with await mesh.connect(ROOT) as root:  # edge-2 keeps its role: only a root admin takes it
        assert await root.get(PKI_CRL) is not None


async def test_a_crl_follower_reads_pki_crl_and_nothing_else(mesh: Mesh) -> None:
    with pytest.raises(StorePermissionDenied):  # it may not count the prefix, as Store.connect does
        await mesh.connect(ETCD)
    async with await mesh.connect(ETCD, probe=PKI_CRL) as follower:
        assert await follower.get(PKI_CRL) is None and await follower.revision() > 0
        with pytest.raises(StorePermissionDenied):
            await follower.get(site_key("edge-1"))
        with pytest.raises(StorePermissionDenied):
            await follower.put(PKI_CRL, {"forged": True})


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ss") is None,
                    reason="resetting etcd's connections (ss -K) needs root (CAP_NET_ADMIN) and iproute2's ss")
async def test_follow_crl_refuses_new_connections_and_ends_open_ones(mesh: Mesh) -> None:
    port = urlsplit(mesh.srv.url).port
    assert port is not None
    # etcd's file lost (a fresh volume): etcd now refuses everyone, the follower too, until the follower starts it
    # from the host's own crl.pem
    mesh.crl_file.unlink()
    assert await _refused(mesh, ROOT)
    follower = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tiermesh", "pki", "follow-crl", "--home", str(mesh.home), *mesh.etcd_args(ETCD),
        "--out", str(mesh.crl_file), "--drop-connections", str(port),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    edge = other = None
    try:
        assert follower.stdout is not None
        line = await asyncio.wait_for(follower.stdout.readline(), 60)
        assert b"following etcd pki/crl" in line and b"list held: 1" in line, line
        edge, other = await Holder.open(mesh, EDGE), await Holder.open(mesh, OTHER)
        async with await mesh.connect(ROOT) as root:
            await root.put("topology/before", {"v": 0})
        await eventually(lambda: _both_saw(edge, other, "topology/before"), 5, "both watches deliver")

        assert await asyncio.to_thread(mesh.revoke, EDGE) == EXIT_OK
        revoked = time.monotonic()
        crl = await eventually(lambda: _number(mesh, 2), 5, "the follower writes list 2 into etcd's CRL file")
        written = time.monotonic()
        assert crl.is_revoked(mesh.pki.certificate(EDGE).serial_number)
        assert await _refused(mesh, EDGE) and not await _refused(mesh, OTHER)  # at the handshake
        refused = time.monotonic()
        with pytest.raises(StoreError):
            await mesh.connect(EDGE)
        async with await mesh.connect(ROOT) as root:  # everyone else still connects
            await asyncio.sleep(1.0)  # the reset has happened; the other site's watch has resumed
            await root.put("topology/after", {"v": 1})
        await eventually(lambda: _saw(other, "topology/after"), 5, "the other site's watch resumes after the reset")
        await asyncio.sleep(1.0)
        assert not edge.saw("topology/after")  # the revoked site's watch ended with its connection
        print(f"\nlist written to etcd's file {written - revoked:.3f} s after revoke; a new connection refused at "
              f"{refused - revoked:.3f} s; the open watch delivered nothing after the reset")
    finally:
        for h in (edge, other):
            if h is not None:
                await h.close()
        if follower.returncode is None:
            follower.terminate()
        _, err = await follower.communicate()
        assert b"reset" in err and b"connection(s) to port" in err, err.decode()[-2000:]


async def _refused(m: Mesh, who: Identity) -> bool:
    """Whether etcd refuses a TLS connection with ``who``'s certificate (TLS 1.3: the client learns it at its
    first read, as an alert or a reset)."""
    ctx = ssl.create_default_context(cafile=str(m.pki.paths.ca_cert))
    ctx.load_cert_chain(m.pki.paths.cert(who), m.pki.paths.key(who))
    ctx.set_alpn_protocols(["h2"])
    url = urlsplit(m.srv.url)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(url.hostname, url.port, ssl=ctx), 5)
    except (ssl.SSLError, ConnectionError):
        return True
    try:
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # preface, SETTINGS
        return await asyncio.wait_for(reader.read(9), 5) == b""
    except (ssl.SSLError, ConnectionError):
        return True
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()


async def _number(m: Mesh, number: int) -> RevocationList | None:
    crl = RevocationList.load(m.crl_file.read_bytes(), m.pki.ca().cert)
    return crl if crl.number >= number else None


async def _saw(h: Holder, key: str) -> bool:
    return h.saw(key)


async def _both_saw(a: Holder, b: Holder, key: str) -> bool:
    return a.saw(key) and b.saw(key)


async def test_a_site_added_to_a_running_mesh_gets_its_etcd_role_from_pki_issue(
        mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    """`tiermesh pki issue --site S` as a root admin: S's certificate is published and S's etcd user and role are
    made (it may connect, write its own heartbeat and certificate, nothing of another site's); as an operator who
    may not manage users, it says what is left to do."""
    new = Identity("site", "edge-3")

    def issue(as_: Identity) -> int:
        return main(["pki", "issue", "--home", str(mesh.home), "--site", new.name, *mesh.etcd_args(as_)])

    assert await asyncio.to_thread(issue, OP) == 0
    assert "give site:edge-3 its etcd role with `tiermesh etcd-rbac`" in capsys.readouterr().err
    with pytest.raises(StorePermissionDenied):
        await mesh.connect(new)
    assert await asyncio.to_thread(issue, ROOT) == 0
    assert "etcd user site:edge-3 has role tiermesh-site:edge-3" in capsys.readouterr().err
    async with await mesh.connect(new) as store:
        await store.put(live_key(new.name), {"ok": 1})
        assert await store.get(site_cert_key(new.name)) is not None
        with pytest.raises(StorePermissionDenied):
            await store.put(live_key("edge-1"), {"forged": True})
