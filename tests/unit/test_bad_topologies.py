"""Every file in tests/data/bad_topologies/ is rejected with its own message, line and field,
and ``tiermesh topology validate`` exits 2 with ``file:line: field: what`` on stderr.

Each bad file marks the offending line with ``# <-- ERROR``; the table below states the line
too, so a drifting file or loader fails loudly either way.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mesh.errors import TopologyError
from tests.helpers.topologies import EXAMPLE
from tiermesh.cli import main as mesh_cli
from topology.loader import load_topology_file

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
BAD = ROOT / "tests" / "data" / "bad_topologies"

# file stem -> (line, field, message fragment)
CASES: dict[str, tuple[int, str | None, str]] = {
    "yaml_syntax": (25, None, "YAML syntax error: expected ',' or '}'"),
    "duplicate_yaml_key": (14, None, 'found duplicate key "tier"'),
    "not_mapping": (1, None, "top level must be a mapping with keys schema, sites, links, tenants, got a list"),
    "empty_file": (1, None, "top level must be a mapping with keys schema, sites, links, tenants, got nothing"),
    "missing_schema": (1, "schema", "missing schema version (add 'schema: 1')"),
    "schema_version": (1, "schema", "unsupported schema version 2 (this tiermesh reads 1)"),
    "unknown_top_key": (25, "tenant", "unknown key 'tenant' (did you mean 'tenants'?)"),
    "unknown_site_key": (16, "sites[1].hardwre", "unknown key 'hardwre' (did you mean 'hardware'?)"),
    "missing_field": (12, "sites[1].region", "missing required field 'region'"),
    "wrong_type": (8, "sites[0].hardware.cpu_cores", "expected an integer, got string 'sixteen'"),
    "zero_cpu": (21, "sites[2].hardware.cpu_cores", "must be > 0, got 0"),
    "bad_tier": (13, "sites[1].tier", "invalid value 'cloud': must be one of edge, middle, core"),
    "duplicate_site": (17, "sites[2].name", "duplicate site name 'mid-a' (first defined at line 12)"),
    "duplicate_tenant": (27, "tenants[1].name", "duplicate tenant 'acme'"),
    "bad_name": (17, "sites[2].name", "invalid name 'Edge_A'"),
    "negative_latency": (23, "links[0].latency_ms", "must be >= 0, got -3"),
    "zero_bandwidth": (24, "links[1].bandwidth_mbps", "must be > 0, got 0"),
    "unknown_link_site": (24, "links[1].b", "link to unknown site 'core-b' (did you mean 'core-a'?)"),
    "self_link": (24, "links[1].b", "self-link: both ends are 'mid-a'"),
    "duplicate_link": (25, "links[2]", "duplicate link between 'edge-a' and 'mid-a' (first defined at line 23)"),
    "edge_edge_link": (31, "links[3]", "edge-to-edge link 'edge-a' - 'edge-b' is not allowed"),
    "edge_no_upstream": (22, "sites[3]", "edge site 'edge-b' has no link to a middle or core site"),
    "disconnected": (22, "sites[3]", "site 'mid-b' is not reachable from the other sites"),
    "bad_isolation": (26, "tenants[0].isolation", "invalid value 'private': must be one of shared, strict"),
    "negative_quota": (26, "tenants[0].quotas.qps", "must be >= 0, got -5"),
    "unknown_quota": (26, "tenants[0].quotas.qpz", "unknown key 'qpz' (did you mean 'qps'?)"),
    "gpu_no_memory": (10, "sites[0].hardware.gpus[0].memory_mb", "missing required field 'memory_mb'"),
    "latitude_range": (20, "sites[2].coordinates.lat", "must be <= 90, got 95"),
}


def _marker_line(path: Path) -> int:
    lines = [i for i, text in enumerate(path.read_text().splitlines(), 1) if "# <-- ERROR" in text]
    assert len(lines) == 1, f"{path.name} must mark exactly one line"
    return lines[0]


def test_every_file_has_a_case() -> None:
    files = {p.stem for p in BAD.glob("*.yaml")}
    assert files == set(CASES)
    assert len(files) >= 15
    # field + message together are distinct per file ("must be > 0" is shared by cpu and bandwidth)
    assert len({(f, msg) for _, f, msg in CASES.values()}) == len(CASES), "each case needs its own message"


@pytest.mark.parametrize("stem", sorted(CASES))
def test_bad_file_is_rejected_precisely(stem: str) -> None:
    path = BAD / f"{stem}.yaml"
    line, field, fragment = CASES[stem]
    assert _marker_line(path) == line
    with pytest.raises(TopologyError) as ei:
        load_topology_file(path)
    err = ei.value
    assert err.file == str(path)
    assert err.line == line
    assert err.field == field
    assert fragment in err.reason
    where = f"{path}:{line}: {field}: " if field else f"{path}:{line}: "
    assert str(err) == where + err.reason


@pytest.fixture
def topology_cli_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # Other command groups are built in parallel; an import error in one of them must not hide ours.
    monkeypatch.setattr(mesh_cli, "_GROUPS", ("tiermesh.cli.topology",))


@pytest.mark.parametrize("stem", sorted(CASES))
def test_cli_validate_exits_2(stem: str, topology_cli_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    path = BAD / f"{stem}.yaml"
    line, field, fragment = CASES[stem]
    assert mesh_cli.main(["topology", "validate", str(path)]) == mesh_cli.EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert f"{path}:{line}: " in err and fragment in err
    if field:
        assert f"{path}:{line}: {field}: " in err
    assert "ok (" not in out


def test_cli_validate_good_file(topology_cli_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    example = EXAMPLE
    assert mesh_cli.main(["topology", "validate", str(example)]) == mesh_cli.EXIT_OK
    out = capsys.readouterr().out
    assert "ok (7 sites, 8 links, 3 tenants)" in out
    assert "core-eu" in out and "gpu-a100" in out


_RUN_CLI = ("import sys; from tiermesh.cli import main as cli; cli._GROUPS = ('tiermesh.cli.topology',); "
            "sys.exit(cli.main(sys.argv[1:]))")


@pytest.mark.parametrize("stem", ["unknown_site_key", "edge_edge_link"])
def test_cli_subprocess_reports_file_line_field(stem: str) -> None:
    path = BAD / f"{stem}.yaml"
    line, field, fragment = CASES[stem]
    proc = subprocess.run([sys.executable, "-c", _RUN_CLI, "topology", "validate", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    assert f"{path}:{line}: {field}: {fragment}" in proc.stderr
