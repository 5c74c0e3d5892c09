"""The etcd key space of DESIGN.md, relative to the Store prefix (default ``/tiermesh/``).

Only pure string helpers: every module that reads or writes etcd names its keys through these,
so the layout lives in one place.
"""

from __future__ import annotations

__all__ = [
    "CATALOG",
    "ELECTION_SCHEDULER",
    "LINKS",
    "LIVE",
    "PKI",
    "PLACEMENT",
    "SITES",
    "TENANTS",
    "blobs_key",
    "catalog_key",
    "last_segment",
    "link_key",
    "live_key",
    "parse_catalog_key",
    "parse_link_key",
    "placement_key",
    "site_key",
    "tenant_key",
]

SITES = "topology/sites/"
LINKS = "topology/links/"
TENANTS = "tenants/"
CATALOG = "catalog/"
LIVE = "live/"
PLACEMENT = "placement/"
PKI = "pki/"
ELECTION_SCHEDULER = "election/scheduler"
_BLOBS = "services/variant-store"


def _segment(kind: str, name: str) -> str:
    # A '/' inside a name would silently create a deeper key that prefix scans then misread.
    if not name or "/" in name:
        raise ValueError(f"invalid {kind} name {name!r}: must be non-empty and contain no '/'")
    return name


def site_key(name: str) -> str:
    return SITES + _segment("site", name)


def link_key(a: str, b: str) -> str:
    """Links are undirected: the endpoints are stored sorted, so (a, b) and (b, a) are one key."""
    x, y = sorted((_segment("site", a), _segment("site", b)))
    if x == y:
        raise ValueError(f"a link needs two different sites, got {a!r} twice")
    return f"{LINKS}{x}/{y}"


def parse_link_key(key: str) -> tuple[str, str]:
    """``topology/links/<a>/<b>`` -> ``(a, b)``; ValueError for anything else."""
    if not key.startswith(LINKS):
        raise ValueError(f"not a link key: {key!r}")
    parts = key[len(LINKS):].split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"not a link key: {key!r}")
    return parts[0], parts[1]


def tenant_key(name: str) -> str:
    return TENANTS + _segment("tenant", name)


def catalog_key(task: str, variant: str) -> str:
    return f"{CATALOG}{_segment('task', task)}/{_segment('variant', variant)}"


def parse_catalog_key(key: str) -> tuple[str, str]:
    """``catalog/<task>/<variant>`` -> ``(task, variant)``."""
    if not key.startswith(CATALOG):
        raise ValueError(f"not a catalog key: {key!r}")
    parts = key[len(CATALOG):].split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"not a catalog key: {key!r}")
    return parts[0], parts[1]


def live_key(site: str) -> str:
    return LIVE + _segment("site", site)


def placement_key(site: str) -> str:
    return PLACEMENT + _segment("site", site)


def blobs_key() -> str:
    """Where the variant store announces the URL of its blob HTTP server."""
    return _BLOBS


def last_segment(key: str) -> str:
    """``live/edge-1`` -> ``edge-1``: the name part of a one-level key (sites, tenants, live, ...)."""
    return key.rstrip("/").rsplit("/", 1)[-1]
