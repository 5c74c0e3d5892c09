"""Settings in one place. Each process builds one ``MeshSettings`` (env prefix ``TIERMESH_``);
nothing reads ``os.environ`` at import time."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from mesh.addresses import DEFAULT_BIND, advertised_host

__all__ = ["MeshSettings"]


class MeshSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIERMESH_", extra="ignore")

    home: Path = Field(default=Path(".tiermesh"),
                       description="Local state directory: embedded etcd data, blob store, logs.")
    etcd: Annotated[list[str] | None, NoDecode] = Field(
        default=None, description="URLs of the members of an existing etcd cluster (a list, or comma-separated: "
                                  "http://a:2379,http://b:2379; https:// needs `etcd_ca`). "
                                  "None: embedded etcd in `home`.")
    etcd_ca: Path | None = Field(default=None, description="PEM file of the CA that signed the etcd members' "
                                                           "certificates (https:// etcd URLs).")
    etcd_cert: Path | None = Field(default=None, description="PEM client certificate for etcd's client-cert auth "
                                                             "(with `etcd_key`).")
    etcd_key: Path | None = Field(default=None, description="PEM private key of `etcd_cert`.")
    prefix: str = Field(default="/tiermesh/", description="Key prefix of everything tiermesh writes to etcd.")
    log_format: str = Field(default="text", description="'text' for people, 'json' for machines.")
    log_level: str = Field(default="INFO", description="Python logging level name.")
    agent_idle_unload_s: float = Field(default=120.0,
                                       description="Seconds an agent keeps a variant that placement no longer asks "
                                                   "for, after its last use, before unloading it.")
    agent_demand_window_s: float = Field(default=10.0,
                                         description="Window over which an agent measures the demand it reports "
                                                     "per task and SLO class (queries/s).")
    agent_trace_sample_rate: float = Field(default=0.01, ge=0.0, le=1.0,
                                           description="Share of queries an agent traces without being asked "
                                                       "(decision traces at GET /v2/traces/ID); 0: only queries "
                                                       "that ask with parameters.trace.")
    agent_trace_buffer: int = Field(default=1000, ge=1,
                                    description="How many traces an agent keeps (the oldest goes first).")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, description="Largest HTTP / wire request accepted.")
    bind: str = Field(default=DEFAULT_BIND,
                      description="Address servers listen on (agent HTTP + ZeroMQ, variant store): an interface "
                                  "address, or 0.0.0.0 / :: for every interface (then `advertise` is required).")
    advertise: str | None = Field(default=None,
                                  description="Address peers should dial, written into the live record and the "
                                              "variant store's announcement. None: the bind address.")
    console_token: str | None = Field(default=None,
                                      description="Token the admin console asks for when it runs without TLS "
                                                  "(`tiermesh scheduler --insecure`). None: a fresh one, printed.")

    def advertised_host(self, bind: str | None = None, advertise: str | None = None) -> str:
        """What peers dial: the given values first (a command line), then these settings; a
        wildcard bind without an advertised address raises ``ConfigError``."""
        return advertised_host(bind or self.bind, advertise or self.advertise)

    @field_validator("etcd", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        # TIERMESH_ETCD=http://a:2379,http://b:2379 (not JSON); checked further by mesh.etcd.endpoints
        if isinstance(value, str):
            value = [u.strip() for u in value.split(",") if u.strip()]
        elif isinstance(value, list | tuple):
            value = [u.strip() for item in value for u in str(item).split(",") if u.strip()]
        return value or None
