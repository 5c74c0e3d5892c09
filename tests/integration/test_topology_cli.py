"""``tiermesh topology validate | diff | apply | show`` in-process against a real etcd."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from mesh.etcd.keys import link_key
from mesh.etcd.store import Store
from tests.helpers.topologies import EXAMPLE
from tiermesh.cli import main as mesh_cli
from topology.loader import load_topology_file
from topology.store_io import desired_state, load_topology

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BAD = ROOT / "tests" / "data" / "bad_topologies"


@pytest.fixture(autouse=True)
def _topology_cli_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # Other command groups are built in parallel; an import error in one must not hide ours.
    monkeypatch.setattr(mesh_cli, "_GROUPS", ("tiermesh.cli.topology",))


async def _cli(store: Store, *argv: str) -> int:
    # main() runs its own event loop (asyncio.run), so it cannot share the test's loop.
    args = ["topology", *argv, "--etcd", store.url, "--prefix", store.prefix]
    return await asyncio.to_thread(mesh_cli.main, args)


def _edited(tmp_path: Path, latency: int) -> Path:
    text = EXAMPLE.read_text().replace("{a: mid-us, b: core-eu, latency_ms: 70,",
                                       f"{{a: mid-us, b: core-eu, latency_ms: {latency},")
    out = tmp_path / "edited.yaml"
    out.write_text(text)
    return out


async def test_apply_reapply_diff_show(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = load_topology_file(EXAMPLE)
    assert await _cli(store, "apply", str(EXAMPLE)) == 0
    out = capsys.readouterr().out
    assert "+ topology/sites/core-eu" in out and "+ tenants/globex" in out
    assert f"applied: {len(desired_state(topo))} added, 0 changed, 0 removed" in out
    assert await load_topology(store) == topo

    rev = await store.revision()
    assert await _cli(store, "apply", str(EXAMPLE)) == 0
    assert "no changes" in capsys.readouterr().out
    assert await store.revision() == rev

    edited = _edited(tmp_path, 80)
    assert await _cli(store, "diff", str(edited)) == 0
    out = capsys.readouterr().out
    key = link_key("mid-us", "core-eu")
    assert f"~ {key}  latency_ms: 70.0 -> 80.0" in out
    assert "0 added, 1 changed, 0 removed" in out
    assert await store.revision() == rev  # diff writes nothing

    assert await _cli(store, "apply", str(edited)) == 0
    assert f"~ {key}" in capsys.readouterr().out
    assert await _cli(store, "show", "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == load_topology_file(edited).to_dict()

    assert await _cli(store, "show") == 0
    out = capsys.readouterr().out
    for name in topo.sites:
        assert name in out


async def test_show_without_topology_fails(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    assert await _cli(store, "show") == mesh_cli.EXIT_FAILED
    assert "no topology applied" in capsys.readouterr().err


@pytest.mark.parametrize("stem", ["disconnected", "wrong_type", "yaml_syntax"])
async def test_bad_file_writes_nothing(stem: str, store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    await store.put("sentinel", {"v": 1})  # so the prefix is known to be reachable and readable
    rev = await store.revision()
    path = BAD / f"{stem}.yaml"
    for action in ("apply", "diff"):
        assert await _cli(store, action, str(path)) == mesh_cli.EXIT_BAD_INPUT
        assert f"{path}:" in capsys.readouterr().err
    assert await store.revision() == rev
    assert [kv.key for kv in await store.get_prefix("")] == ["sentinel"]


async def test_unreachable_etcd_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["topology", "apply", str(EXAMPLE), "--etcd", f"http://127.0.0.1:{port}", "--prefix", "/nobody/"]
    assert await asyncio.to_thread(mesh_cli.main, args) == mesh_cli.EXIT_UNREACHABLE
    assert "etcd unreachable" in capsys.readouterr().err
