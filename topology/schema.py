"""Typed topology objects (schema version 1) and their JSON form for etcd values.

The objects are frozen: a topology is a value, replaced as a whole when a new file is applied.
Validation of operator input lives in ``topology.loader``; constructors here only normalise
(a link's endpoints are stored with ``a < b``; a topology's links are sorted) so that two
topologies that mean the same thing compare equal whatever order the file used.

Units: latencies are one-way milliseconds, bandwidth is megabits per second, memory is MiB,
``price_per_hour`` is USD per hour for the whole site's hardware.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from mesh.types import Tier
from mesh.webhooks import parse_prefix

__all__ = [
    "ISOLATIONS",
    "MAX_WEBHOOKS",
    "MAX_WEBHOOK_CA",
    "QUOTA_KEYS",
    "SCHEMA_VERSION",
    "Gpu",
    "Hardware",
    "Isolation",
    "Link",
    "Site",
    "Tenant",
    "Topology",
]

SCHEMA_VERSION = 1
Isolation = Literal["shared", "strict"]
ISOLATIONS: tuple[str, ...] = ("shared", "strict")
# Quotas per tenant: ``qps`` and ``max_inflight`` the edge enforces, ``storage_mb`` (MiB) the variant store's data
# area (``variant_store.data_quotas``, which spells the key again: it may not import this layer). An unknown key is
# a typo the loader reports rather than ignores.
QUOTA_KEYS: tuple[str, ...] = ("qps", "max_inflight", "storage_mb")
MAX_WEBHOOKS = 16          # allowed notification prefixes per tenant
MAX_WEBHOOK_CA = 64 << 10  # PEM characters of a tenant's webhook CA bundle (it lives in the tenant's etcd value)


def _dumps(obj: dict[str, Any]) -> str:
    # Canonical text: the same object always yields the same bytes, so digests and diffs are stable.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _loads(text: str | bytes | dict[str, Any]) -> dict[str, Any]:
    if isinstance(text, dict):
        return text
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("topology JSON value must be an object")
    return cast(dict[str, Any], data)


@dataclass(frozen=True, slots=True)
class Gpu:
    model: str
    memory_mb: int

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "memory_mb": self.memory_mb}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Gpu:
        return cls(model=str(d["model"]), memory_mb=int(d["memory_mb"]))


@dataclass(frozen=True, slots=True)
class Hardware:
    cpu_cores: int
    memory_mb: int
    gpus: tuple[Gpu, ...] = ()
    price_per_hour: float = 0.0

    @property
    def hardware_class(self) -> str:
        """Key of variant profiles: ``"cpu"`` or ``"gpu-<model>"`` of the first GPU (e.g. ``gpu-a100``)."""
        if not self.gpus:
            return "cpu"
        slug = re.sub(r"[^a-z0-9]+", "-", self.gpus[0].model.lower()).strip("-")
        return f"gpu-{slug}"

    def to_dict(self) -> dict[str, Any]:
        return {"cpu_cores": self.cpu_cores, "memory_mb": self.memory_mb,
                "gpus": [g.to_dict() for g in self.gpus], "price_per_hour": self.price_per_hour}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Hardware:
        return cls(cpu_cores=int(d["cpu_cores"]), memory_mb=int(d["memory_mb"]),
                   gpus=tuple(Gpu.from_dict(g) for g in d.get("gpus", [])),
                   price_per_hour=float(d.get("price_per_hour", 0.0)))


@dataclass(frozen=True, slots=True)
class Site:
    name: str
    tier: Tier
    region: str
    lat: float
    lon: float
    hardware: Hardware

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, "name": self.name, "tier": self.tier, "region": self.region,
                "coordinates": {"lat": self.lat, "lon": self.lon}, "hardware": self.hardware.to_dict()}

    def to_json(self) -> str:
        return _dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Site:
        coords = d["coordinates"]
        return cls(name=str(d["name"]), tier=cast(Tier, d["tier"]), region=str(d["region"]),
                   lat=float(coords["lat"]), lon=float(coords["lon"]),
                   hardware=Hardware.from_dict(d["hardware"]))

    @classmethod
    def from_json(cls, text: str | bytes | dict[str, Any]) -> Site:
        return cls.from_dict(_loads(text))


@dataclass(frozen=True, slots=True)
class Link:
    """An undirected link; endpoints are normalised so that ``a < b``."""

    a: str
    b: str
    latency_ms: float
    bandwidth_mbps: float
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.b < self.a:
            a, b = self.b, self.a
            object.__setattr__(self, "a", a)
            object.__setattr__(self, "b", b)

    @property
    def ends(self) -> tuple[str, str]:
        return (self.a, self.b)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, "a": self.a, "b": self.b, "latency_ms": self.latency_ms,
                "bandwidth_mbps": self.bandwidth_mbps, "jitter_ms": self.jitter_ms}

    def to_json(self) -> str:
        return _dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Link:
        return cls(a=str(d["a"]), b=str(d["b"]), latency_ms=float(d["latency_ms"]),
                   bandwidth_mbps=float(d["bandwidth_mbps"]), jitter_ms=float(d.get("jitter_ms", 0.0)))

    @classmethod
    def from_json(cls, text: str | bytes | dict[str, Any]) -> Link:
        return cls.from_dict(_loads(text))


@dataclass(frozen=True)
class Tenant:
    """``webhooks``: the https URL prefixes its jobs may notify (canonical text, ``mesh.webhooks``); ``webhook_ca``:
    the PEM of the CAs that verify those receivers (None: the system's trust store)."""

    name: str
    isolation: Isolation = "shared"
    quotas: dict[str, float] = field(default_factory=dict)
    webhooks: tuple[str, ...] = ()
    webhook_ca: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA_VERSION, "name": self.name, "isolation": self.isolation,
                               "quotas": dict(self.quotas)}
        # only when set: a topology without webhooks keeps the JSON (and the digest) it had before they existed
        if self.webhooks:
            out["webhooks"] = list(self.webhooks)
        if self.webhook_ca is not None:
            out["webhook_ca"] = self.webhook_ca
        return out

    def to_json(self) -> str:
        return _dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tenant:
        hooks = d.get("webhooks", [])
        ca = d.get("webhook_ca")
        if not isinstance(hooks, list) or len(hooks) > MAX_WEBHOOKS:
            raise ValueError(f"a tenant's webhooks are a list of at most {MAX_WEBHOOKS} URL prefixes")
        if ca is not None and not (isinstance(ca, str) and len(ca) <= MAX_WEBHOOK_CA):
            raise ValueError(f"a tenant's webhook_ca is PEM text of at most {MAX_WEBHOOK_CA} characters")
        return cls(name=str(d["name"]), isolation=cast(Isolation, d.get("isolation", "shared")),
                   quotas={str(k): float(v) for k, v in d.get("quotas", {}).items()},
                   webhooks=tuple(parse_prefix(h).text for h in hooks), webhook_ca=ca)

    @classmethod
    def from_json(cls, text: str | bytes | dict[str, Any]) -> Tenant:
        return cls.from_dict(_loads(text))


@dataclass(frozen=True)
class Topology:
    """Sites by name, links sorted by endpoints, tenants by name. Paths over it come from
    ``topology.paths.topology_paths``."""

    sites: dict[str, Site]
    links: tuple[Link, ...] = ()
    tenants: dict[str, Tenant] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", tuple(sorted(self.links, key=lambda lk: lk.ends)))

    def sites_in_tier(self, tier: str) -> list[Site]:
        return [s for s in self.sites.values() if s.tier == tier]

    def link(self, a: str, b: str) -> Link | None:
        lo, hi = (a, b) if a < b else (b, a)
        for lk in self.links:
            if lk.a == lo and lk.b == hi:
                return lk
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"schema": self.schema,
                "sites": [self.sites[n].to_dict() for n in sorted(self.sites)],
                "links": [lk.to_dict() for lk in self.links],
                "tenants": [self.tenants[n].to_dict() for n in sorted(self.tenants)]}

    def to_json(self) -> str:
        return _dumps(self.to_dict())

    def digest(self) -> str:
        """sha256 of the canonical JSON: equal topologies have equal digests whatever the file layout."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Topology:
        sites = [Site.from_dict(s) for s in d.get("sites", [])]
        tenants = [Tenant.from_dict(t) for t in d.get("tenants", [])]
        return cls(sites={s.name: s for s in sites},
                   links=tuple(Link.from_dict(lk) for lk in d.get("links", [])),
                   tenants={t.name: t for t in tenants},
                   schema=int(d.get("schema", SCHEMA_VERSION)))

    @classmethod
    def from_json(cls, text: str | bytes | dict[str, Any]) -> Topology:
        return cls.from_dict(_loads(text))
