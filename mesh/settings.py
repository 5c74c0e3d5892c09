"""Settings in one place. Each process builds one ``MeshSettings`` (env prefix ``TIERMESH_``);
nothing reads ``os.environ`` at import time.

A field is read, in order, from a keyword given to ``MeshSettings(...)``, the environment variable
``TIERMESH_<NAME>`` (case-insensitive, as pydantic-settings read it), then its default. Each field has one
parser (the type it becomes) and a description; a value that does not parse is a ``ConfigError`` naming the
variable. Range rules live with the code that uses a value (e.g. the agent's trace sample rate), not here:
one validator per value. Plain dataclasses, not pydantic-settings: an edge agent is a small process, and this
is all the parsing its settings need (pydantic and pydantic-settings cost about 10 MiB of RSS).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.addresses import DEFAULT_BIND, advertised_host
from mesh.errors import ConfigError

__all__ = ["ENV_PREFIX", "MeshSettings", "setting_names"]

ENV_PREFIX = "TIERMESH_"


def _optional(parse: Callable[[str], Any]) -> Callable[[Any], Any]:
    """``parse``, with None and an empty string meaning unset."""
    return lambda v: None if v is None or (isinstance(v, str) and not v.strip()) else parse(v)


def _urls(value: Any) -> list[str] | None:
    # TIERMESH_ETCD=http://a:2379,http://b:2379 (not JSON); checked further by mesh.etcd.endpoints
    items = [value] if isinstance(value, str) else list(value or ())
    urls = [u.strip() for item in items for u in str(item).split(",") if u.strip()]
    return urls or None


def _setting(doc: str, parse: Callable[[Any], Any]) -> dict[str, Any]:
    """A field's metadata: its description and its one parser."""
    return {"doc": doc, "parse": parse}


_path = _optional(Path)


@dataclass(frozen=True, init=False)
class MeshSettings:
    home: Path = field(default=Path(".tiermesh"), metadata=_setting(
        "Local state directory: embedded etcd data, blob store, logs.", Path))
    etcd: list[str] | None = field(default=None, metadata=_setting(
        "URLs of the members of an existing etcd cluster (a list, or comma-separated: http://a:2379,http://b:2379; "
        "https:// needs `etcd_ca`). None: embedded etcd in `home`.", _urls))
    etcd_ca: Path | None = field(default=None, metadata=_setting(
        "PEM file of the CA that signed the etcd members' certificates (https:// etcd URLs).", _path))
    etcd_cert: Path | None = field(default=None, metadata=_setting(
        "PEM client certificate for etcd's client-cert auth (with `etcd_key`).", _path))
    etcd_key: Path | None = field(default=None, metadata=_setting("PEM private key of `etcd_cert`.", _path))
    prefix: str = field(default="/tiermesh/", metadata=_setting(
        "Key prefix of everything tiermesh writes to etcd.", str))
    log_format: str = field(default="text", metadata=_setting("'text' for people, 'json' for machines.", str))
    log_level: str = field(default="INFO", metadata=_setting("Python logging level name.", str))
    agent_idle_unload_s: float = field(default=120.0, metadata=_setting(
        "Seconds an agent keeps a variant that placement no longer asks for, after its last use, before unloading "
        "it.", float))
    agent_demand_window_s: float = field(default=10.0, metadata=_setting(
        "Window over which an agent measures the demand it reports per task and SLO class (queries/s).", float))
    agent_trace_sample_rate: float = field(default=0.01, metadata=_setting(
        "Share of queries an agent traces without being asked (decision traces at GET /v2/traces/ID), in [0, 1] "
        "(checked by the agent); 0: only queries that ask with parameters.trace.", float))
    agent_trace_buffer: int = field(default=1000, metadata=_setting(
        "How many traces an agent keeps, at least 1 (checked by the agent; the oldest goes first).", int))
    max_body_bytes: int = field(default=16 * 1024 * 1024, metadata=_setting(
        "Largest HTTP / wire request accepted.", int))
    bind: str = field(default=DEFAULT_BIND, metadata=_setting(
        "Address servers listen on (agent HTTP + ZeroMQ, variant store): an interface address, or 0.0.0.0 / :: for "
        "every interface (then `advertise` is required).", str))
    advertise: str | None = field(default=None, metadata=_setting(
        "Address peers should dial, written into the live record and the variant store's announcement. None: the "
        "bind address.", _optional(str)))
    console_token: str | None = field(default=None, repr=False, metadata=_setting(  # a secret: not in repr
        "Token the admin console asks for when it runs without TLS (`tiermesh scheduler --insecure`). None: a fresh "
        "one, printed.", _optional(str)))

    def __init__(self, *, environ: Mapping[str, str] | None = None, **values: Any) -> None:
        env = {k.upper(): v for k, v in (os.environ if environ is None else environ).items()
               if k.upper().startswith(ENV_PREFIX)}
        unknown = set(values) - set(setting_names())
        if unknown:
            raise TypeError(f"unknown setting(s): {sorted(unknown)}")
        for f in dataclasses.fields(self):
            name = ENV_PREFIX + f.name.upper()
            if f.name in values:
                raw, source = values[f.name], f.name
            elif name in env:
                raw, source = env[name], name
            else:
                object.__setattr__(self, f.name, f.default)
                continue
            try:
                value = f.metadata["parse"](raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{source}={raw!r}: not a valid {f.name} ({exc})") from exc
            object.__setattr__(self, f.name, value)

    def advertised_host(self, bind: str | None = None, advertise: str | None = None) -> str:
        """What peers dial: the given values first (a command line), then these settings; a
        wildcard bind without an advertised address raises ``ConfigError``."""
        return advertised_host(bind or self.bind, advertise or self.advertise)


def setting_names() -> tuple[str, ...]:
    """The fields of :class:`MeshSettings` (``TIERMESH_<NAME upper-cased>`` each)."""
    return tuple(f.name for f in dataclasses.fields(MeshSettings))
