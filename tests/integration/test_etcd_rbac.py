"""etcd RBAC on a real etcd with TLS and client-certificate auth: certificates from the mesh CA
(:mod:`mesh.pki`), users named by their CN, roles from :func:`mesh.etcd.rbac.plan`."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mesh.errors import StoreError
from mesh.etcd.channels import StorePermissionDenied
from mesh.etcd.keys import EVENTS_PLACEMENT, claim_key, live_key, placement_key, site_key, tenant_key
from mesh.etcd.rbac import apply, plan
from mesh.etcd.server import EmbeddedEtcd, ServerTLS
from mesh.etcd.store import Store
from mesh.pki.files import cert_pem, key_pem, write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki

pytestmark = pytest.mark.integration
PREFIX = "/rbac/"
SITES = ["edge-1", "edge-2"]
_SITE = "{name: %s, tier: %s, region: r, coordinates: {lat: 1, lon: 1}, hardware: {cpu_cores: 2, memory_mb: 1024, " \
        "price_per_hour: 1}}"
_TIERS = ["edge", "core"]
TOPOLOGY = "\n".join(["schema: 1", "sites:", *(f"  - {_SITE % (s, t)}" for s, t in zip(SITES, _TIERS, strict=True)),
                      "links:",
                      f"  - {{a: {SITES[0]}, b: {SITES[1]}, latency_ms: 5, bandwidth_mbps: 100}}", ""])


def _issue(pki: LocalPki, ident: Identity) -> None:
    """A mesh certificate for ``ident`` without the CURVE key extension: etcd (Go) refuses to parse the
    2.25.<uuid> OID of that extension ("asn1: base 128 integer too large"), see the module's report."""
    addresses = ["127.0.0.1", "localhost"] if ident.name == "etcd" else []
    issued = pki.ca().issue(ident, addresses=addresses)
    write_file(pki.paths.key(ident), key_pem(issued.key), private=True)
    write_file(pki.paths.cert(ident), cert_pem(issued.cert))


@pytest.fixture
async def mesh_etcd(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedEtcd, LocalPki]]:
    pki = LocalPki.under(tmp_path)
    pki.init()
    server = Identity("etcd", "etcd")  # server and client EKU, as etcd's own health probe needs
    _issue(pki, server)
    for ident in [*(Identity("site", s) for s in SITES), Identity("scheduler", "s1"), Identity("admin", "root-op"),
                  Identity("admin", "op"), Identity("tenant", "acme")]:
        _issue(pki, ident)
    srv = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True,
                       tls=ServerTLS(pki.paths.cert(server), pki.paths.key(server), pki.paths.ca_cert))
    try:
        await srv.start()
        yield srv, pki
    finally:
        await srv.stop()


def _connect(srv: EmbeddedEtcd, pki: LocalPki, kind: str, name: str, timeout: float = 5.0) -> asyncio.Future[Store]:
    ident = Identity(kind, name)  # type: ignore[arg-type]
    return asyncio.ensure_future(Store.connect(srv.url, PREFIX, ca=pki.paths.ca_cert, cert=pki.paths.cert(ident),
                                               key=pki.paths.key(ident), timeout=timeout))


async def _cli_apply(srv: EmbeddedEtcd, pki: LocalPki, topology: Path) -> None:
    root = Identity("admin", "root-op")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tiermesh", "etcd-rbac", "--topology", str(topology), "--prefix", PREFIX,
        "--scheduler", "s1", "--admin", "op", "--root-admin", "root-op", "--crl-follower", "etcd:etcd",
        "--etcd", srv.url,
        "--etcd-ca", str(pki.paths.ca_cert), "--etcd-cert", str(pki.paths.cert(root)),
        "--etcd-key", str(pki.paths.key(root)),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert b"user site:edge-1: tiermesh-site:edge-1" in out
    assert b"user etcd:etcd: tiermesh-crl-follower" in out


async def test_roles_are_enforced(mesh_etcd: tuple[EmbeddedEtcd, LocalPki], tmp_path: Path) -> None:
    srv, pki = mesh_etcd
    rbac = plan(PREFIX, sites=SITES, schedulers=["s1"], admins=["op"], root_admins=["root-op"])
    async with await _connect(srv, pki, "admin", "root-op") as root:
        await root.put(site_key("edge-1"), {"name": "edge-1"})
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    await _cli_apply(srv, pki, tmp_path / "topo.yaml")  # `tiermesh etcd-rbac` with the root admin's certificate
    async with await _connect(srv, pki, "admin", "root-op") as root:
        await apply(root, rbac)  # idempotent, and the root admin may still manage users once auth is on
        await root.put(tenant_key("acme"), {"name": "acme"})  # root keeps full access
    await srv.restart()  # with auth on, etcd still passes its health probe and keeps users and roles

    with pytest.raises(StorePermissionDenied):  # etcd's own certificate reads pki/crl, not the prefix
        await _connect(srv, pki, "etcd", "etcd")

    async with await _connect(srv, pki, "site", "edge-1") as agent:
        lease = await agent.lease(5)
        await agent.put(live_key("edge-1"), {"ok": 1}, lease=lease)  # its own heartbeat
        assert (await agent.get(live_key("edge-1"))) is not None
        assert (await agent.get(site_key("edge-1"))) is not None  # reads the topology
        async with agent.watch_prefix("live/") as watch:  # and may watch
            await agent.put(live_key("edge-1"), {"ok": 2}, lease=lease)
            ev = await asyncio.wait_for(anext(watch), 10)
            assert ev.value == {"ok": 2}
        with pytest.raises(StorePermissionDenied, match="permission denied"):
            await agent.put(live_key("edge-2"), {"forged": True})  # another site's live key
        with pytest.raises(StorePermissionDenied):
            await agent.put(placement_key("edge-1"), {"forged": True})
        with pytest.raises(StorePermissionDenied):
            await agent.delete(site_key("edge-1"))
        await agent.put(claim_key("0" * 32, 0), {"site": "edge-1"}, lease=lease)  # offline jobs: claims, commits
        await lease.revoke()

    async with await _connect(srv, pki, "scheduler", "s1") as sched:
        await sched.put(placement_key("edge-1"), {"variants": []})
        await sched.put(EVENTS_PLACEMENT, {"events": []})
        with pytest.raises(StorePermissionDenied):
            await sched.put(site_key("edge-9"), {"name": "edge-9"})
        with pytest.raises(StorePermissionDenied):
            await sched.put(live_key("edge-1"), {"forged": True})

    async with await _connect(srv, pki, "admin", "op") as op:
        await op.put(tenant_key("beta"), {"name": "beta"})
        await op.put("catalog/t/v1", {"v": 1})
        with pytest.raises(StorePermissionDenied):
            await op.put(placement_key("edge-1"), {})
        with pytest.raises(StorePermissionDenied):  # an operator is not root: no user management
            await apply(op, rbac)

    # a tenant has no etcd user: not even the first read succeeds
    with pytest.raises(StorePermissionDenied):
        await _connect(srv, pki, "tenant", "acme")
    # a site not in the plan neither (refused, not mistaken for etcd being down)
    _issue(pki, Identity("site", "edge-9"))
    with pytest.raises(StorePermissionDenied):
        await _connect(srv, pki, "site", "edge-9")
    assert issubclass(StorePermissionDenied, StoreError)


async def test_a_site_certificate_from_pki_issue_is_accepted_by_etcd(
        mesh_etcd: tuple[EmbeddedEtcd, LocalPki]) -> None:
    srv, pki = mesh_etcd
    pki.issue(Identity("site", "edge-1"))  # as `tiermesh pki issue --site`: with the CURVE key extension
    async with await _connect(srv, pki, "site", "edge-1", timeout=3.0) as agent:
        await agent.get(live_key("edge-1"))
