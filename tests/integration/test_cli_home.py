"""Issue 30: every command on a home works whether or not a mesh runs there. A secured ``tiermesh up`` (the default,
``make demo``) leaves etcd data with RBAC on in HOME/etcd; with the mesh stopped, the commands' temporary etcd
started there over plain HTTP and every command failed with ``etcd unreachable: ... INVALID_ARGUMENT: etcdserver:
user name is empty``. The home here is made as ``tiermesh up`` makes it (its credentials, etcd with TLS and client
certificates, RBAC, the topology, a catalog entry), stopped, and then used through the command line."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from mesh.etcd import rbac
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from tests.integration.test_catalog import _meta
from tiermesh.cli.main import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNREACHABLE, main
from tiermesh.secure import OPERATOR, MeshCredentials, rbac_plan
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.catalog import Catalog

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "tests" / "data" / "topology_small.yaml"
PREFIX = "/tiermesh/"
VARIANT = "mlp-tiny.onnx.int8-dynamic"


async def _secure_a_home(home: Path) -> None:
    """What a secured `tiermesh up` leaves behind once stopped (tiermesh.harness: _issue_certificates, start_etcd)."""
    topo = load_topology_file(TOPOLOGY)
    creds = MeshCredentials.under(home)
    creds.issue(dict.fromkeys(topo.sites, "127.0.0.1"), ["public"], etcd_address="127.0.0.1",
                store_address="127.0.0.1")
    etcd = EmbeddedEtcd(home / "etcd", tls=creds.etcd_server(), unsafe_no_fsync=True)
    await etcd.start()
    try:
        async with await Store.connect(etcd.url, PREFIX, **creds.files(OPERATOR)) as store:
            await rbac.apply(store, rbac_plan(PREFIX, topo.sites))
            await apply_topology(store, topo)
            await Catalog(store).put_variant(_meta(VARIANT))
    finally:
        await etcd.stop()


@pytest.fixture(scope="module")
def secured_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("home") / ".tiermesh"
    asyncio.run(_secure_a_home(home))
    return home


def test_commands_on_a_stopped_secured_home_run_as_its_operator(secured_home: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    home = ["--home", str(secured_home)]
    assert main(["topology", "show", "--json", *home]) == EXIT_OK, capsys.readouterr().err
    shown = json.loads(capsys.readouterr().out)
    assert {s["name"] for s in shown["sites"]} == {"core-eu", "mid-eu", "edge-fra-1", "edge-par-1"}
    assert main(["variants", "list", "--task", "digit-classification", "--json", *home]) == EXIT_OK, \
        capsys.readouterr().err
    assert [v["id"] for v in json.loads(capsys.readouterr().out)] == [VARIANT]


def test_an_insecure_mesh_on_a_secured_home_is_refused_in_plain_words(secured_home: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["up", "--insecure", "--home", str(secured_home), "--topology", str(TOPOLOGY), "--no-text"])
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT, err
    assert "secured mesh" in err and "--home" in err and "Traceback" not in err


def test_a_home_whose_etcd_has_auth_on_but_no_pki_says_what_to_do(secured_home: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "copy"
    home.mkdir()
    (home / "etcd").symlink_to(secured_home / "etcd")  # the secured data, without the PKI beside it
    rc = main(["topology", "show", "--home", str(home)])
    err = capsys.readouterr().err
    assert rc == EXIT_UNREACHABLE, err
    assert "http://127.0.0.1:" in err and "authentication on" in err and "another --home" in err
    assert "Traceback" not in err
