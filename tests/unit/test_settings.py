"""MeshSettings: each field from a keyword, else ``TIERMESH_<NAME>``, else its default; one parser per field."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.errors import ConfigError
from mesh.settings import MeshSettings, setting_names

pytestmark = pytest.mark.unit


def test_defaults_without_environment() -> None:
    s = MeshSettings(environ={})
    assert s.home == Path(".tiermesh") and s.etcd is None and s.prefix == "/tiermesh/"
    assert s.agent_trace_buffer == 1000 and s.max_body_bytes == 16 * 1024 * 1024


def test_environment_is_parsed_to_each_fields_type() -> None:
    s = MeshSettings(environ={"TIERMESH_ETCD": "https://a:1, https://b:2,", "TIERMESH_HOME": "/srv/tm",
                              "tiermesh_max_body_bytes": "4096", "TIERMESH_AGENT_IDLE_UNLOAD_S": "2.5",
                              "TIERMESH_ETCD_CA": "", "TIERMESH_ADVERTISE": "10.0.0.4", "OTHER": "x"})
    assert s.etcd == ["https://a:1", "https://b:2"]
    assert s.home == Path("/srv/tm") and s.max_body_bytes == 4096 and s.agent_idle_unload_s == 2.5
    assert s.etcd_ca is None and s.advertise == "10.0.0.4"


def test_keywords_win_over_the_environment() -> None:
    s = MeshSettings(environ={"TIERMESH_PREFIX": "/env/", "TIERMESH_ETCD": "http://e:1"},
                     prefix="/kw/", etcd=["http://a:1,http://b:2"])
    assert s.prefix == "/kw/" and s.etcd == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize(("var", "value"), [("TIERMESH_MAX_BODY_BYTES", "lots"),
                                            ("TIERMESH_AGENT_TRACE_SAMPLE_RATE", "often")])
def test_a_value_that_does_not_parse_names_its_variable(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=var):
        MeshSettings(environ={var: value})


def test_unknown_keyword_is_refused_and_every_field_is_documented() -> None:
    with pytest.raises(TypeError, match="nope"):
        MeshSettings(environ={}, nope=1)
    import dataclasses

    for f in dataclasses.fields(MeshSettings):
        assert f.name in setting_names() and f.metadata["doc"].strip(), f.name


def test_reads_os_environ_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERMESH_LOG_LEVEL", "DEBUG")
    assert MeshSettings().log_level == "DEBUG"


def test_the_cli_exits_2_on_a_setting_that_does_not_parse(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from tiermesh.cli.main import EXIT_BAD_INPUT, main

    monkeypatch.setenv("TIERMESH_MAX_BODY_BYTES", "lots")
    assert main(["topology", "validate", "nothing.yaml"]) == EXIT_BAD_INPUT
    assert "TIERMESH_MAX_BODY_BYTES" in capsys.readouterr().err
