"""Issue 28: every site its own host. The small topology's four sites, etcd and the control services each in a
network namespace with a home of its own holding exactly its identity's files (``PkiPaths.host_files``: the CA, the
revocation list, its own certificate, key and CURVE keys), started with the command line the Kubernetes manifests
use (``tiermesh.hosts``), secured as deployed (mutual TLS at the edges, CURVE between sites, etcd with client
certificates and RBAC). Peers learn each other's certificates only through etcd and believe them only because the
CA signed them.

A mixed workload from the edges then meets every class's SLO for >= 95 % of its queries, forwarded ones included
(queries an edge receives served at the core, two links away), nothing lost. On a
main where a site admitted peers only from certificates in its own directory, the core refused every peer's CURVE
handshake here and this test failed (see the issue's note). Skipped where namespaces cannot be made.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from tests.system.conftest import Holdout, mesh_running, wait_warm
from tiermesh.harness import LocalMesh
from tiermesh.hosts import agent_command
from tiermesh.netns import unavailable_reason
from tiermesh.workload import DEFAULT_CLASSES, run_workload, summarise
from topology.paths import topology_paths

REASON = unavailable_reason()
pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")]

SITES = ["core-eu", "mid-eu", "edge-fra-1", "edge-par-1"]
RUN_S, QPS = 12.0, 20.0


def _files(home: Path) -> set[str]:
    return {str(p.relative_to(home)) for p in (home / "pki").rglob("*") if p.is_file()}


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _holds_only_its_own_files(mesh: LocalMesh) -> None:
    for name in SITES:
        home = mesh.host_home(name)
        want = {str(p.relative_to(home)) for p in PkiPaths.under(home).host_files(Identity("site", name)).values()}
        assert _files(home) == want, (name, _files(home))
        sp = mesh.sites[name]
        assert sp.proc is not None
        deployed = list(agent_command(name, home=str(home), advertise=mesh.lab.host(name).address).args)  # type: ignore[union-attr]
        argv = _cmdline(sp.proc.pid)
        start = argv.index("agent")
        assert argv[start:start + len(deployed)] == deployed, argv  # the manifests' command line, then lab plumbing
        assert not any("pki" in a and name not in a for a in argv), argv  # no --pki-dir into someone else's files


async def test_sites_holding_only_their_own_identity_serve_and_forward(holdout: Holdout) -> None:
    async with mesh_running(netns=True, tls=True, sites=SITES) as mesh:
        _holds_only_its_own_files(mesh)
        await wait_warm(mesh, holdout.x)
        edges = mesh.edge_urls()
        for url in edges.values():
            await mesh.check_dial(url)
        offered = [0]
        result = await run_workload(edges, holdout.x, holdout.y, duration_s=RUN_S, qps=QPS, seed=28,
                                    credentials=mesh.tenant_files, on_tick=lambda n, _t: offered.__setitem__(0, n))
    recs = result.records
    tiers = {n: mesh.topology.sites[n].tier for n in SITES}
    summary = summarise(recs, tiers)
    print(json.dumps(summary))  # the numbers, for whoever reads the log
    assert offered[0] > 150 and len(recs) == offered[0], f"{offered[0] - len(recs)} queries lost"
    # forwarded over two links: an edge's query served at the core crosses edge-mid and mid-core
    assert all(len(topology_paths(mesh.topology).path(edge, "core-eu")) == 3 for edge in edges)
    served_at = Counter(r.site for r in recs if r.ok)
    assert served_at["core-eu"] >= 0.2 * len(recs), served_at
    for cls in DEFAULT_CLASSES:
        mine = [r for r in recs if r.slo_class == cls.name]
        met = sum(r.met for r in mine)
        assert met >= 0.95 * len(mine), f"{cls.name}: {met}/{len(mine)} met ({Counter(r.site for r in mine)})"
    forwarded = [r for r in recs if r.ok and r.site != r.edge]
    assert sum(r.met for r in forwarded) >= 0.95 * len(forwarded), "forwarded queries missed their SLO"
    errors = Counter(r.error for r in recs if r.error)
    assert not errors, errors
