"""Settings in one place. Each process builds one ``MeshSettings`` (env prefix ``TIERMESH_``);
nothing reads ``os.environ`` at import time."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from mesh.addresses import DEFAULT_BIND, advertised_host

__all__ = ["MeshSettings"]


class MeshSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIERMESH_", extra="ignore")

    home: Path = Field(default=Path(".tiermesh"),
                       description="Local state directory: embedded etcd data, blob store, logs.")
    etcd: str | None = Field(default=None,
                             description="URL of an existing etcd (http://host:port). None: embedded etcd in `home`.")
    prefix: str = Field(default="/tiermesh/", description="Key prefix of everything tiermesh writes to etcd.")
    log_format: str = Field(default="text", description="'text' for people, 'json' for machines.")
    log_level: str = Field(default="INFO", description="Python logging level name.")
    agent_idle_unload_s: float = Field(default=120.0,
                                       description="Seconds an agent keeps a variant that placement no longer asks "
                                                   "for, after its last use, before unloading it.")
    agent_demand_window_s: float = Field(default=10.0,
                                         description="Window over which an agent measures the demand it reports "
                                                     "per task and SLO class (queries/s).")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, description="Largest HTTP / wire request accepted.")
    bind: str = Field(default=DEFAULT_BIND,
                      description="Address servers listen on (agent HTTP + ZeroMQ, variant store): an interface "
                                  "address, or 0.0.0.0 / :: for every interface (then `advertise` is required).")
    advertise: str | None = Field(default=None,
                                  description="Address peers should dial, written into the live record and the "
                                              "variant store's announcement. None: the bind address.")

    def advertised_host(self, bind: str | None = None, advertise: str | None = None) -> str:
        """What peers dial: the given values first (a command line), then these settings; a
        wildcard bind without an advertised address raises ``ConfigError``."""
        return advertised_host(bind or self.bind, advertise or self.advertise)
