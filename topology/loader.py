"""Topology YAML -> typed :class:`~topology.schema.Topology`, or one precise error.

Every error is a :class:`mesh.errors.TopologyError` naming the file, the 1-based line and the
field path (``sites[2].hardware.cpu_cores``, indexes 0-based like the list they index), and
saying what is wrong; unknown keys get the closest valid key suggested. The first error found
is raised: checks run in file order, then the whole-graph rules.

Rules beyond types and ranges:

* names of sites and tenants are DNS labels (``[a-z0-9-]``, no leading/trailing ``-``, <= 63
  chars) because they become etcd keys, certificate URIs and metric labels;
* a link joins two different, known sites, at most one link per pair (either order);
  ``latency_ms >= 0`` (one-way), ``bandwidth_mbps > 0``, ``jitter_ms >= 0``;
* **tiers**: an edge site never links to another edge site (edges reach each other through
  their upstream, which keeps edge uplinks the only WAN hop an edge caller pays for twice), and
  every edge site links to at least one middle or core site; middle and core sites may link to
  any non-edge site and to edges;
* every site is reachable from every other (a site that cannot be reached would be placed to
  but never routed to);
* a GPU names its model and its memory; latitude in [-90, 90], longitude in [-180, 180];
* a tenant's isolation is ``shared`` or ``strict``; quotas are known keys (``QUOTA_KEYS``) with values >= 0;
  ``webhooks`` lists https URL prefixes its jobs may notify (``mesh.webhooks``: no userinfo, query or fragment, no
  ``..`` or encoded ``/``; at most ``MAX_WEBHOOKS``, no duplicates) and ``webhook_ca`` names a PEM file of the CAs
  that verify those receivers (relative to the topology file; its certificates are kept in the tenant's record).
  ``shared``: its queries may be batched with other shared tenants' through a backbone the site
  holds once (``edge_agent.backbone``); ``strict``: never a batch, session or backbone instance with
  another tenant (``edge_agent.host`` opens instances of its own, placement charges it a whole
  backbone).
"""

from __future__ import annotations

import difflib
import math
import re
import ssl
from pathlib import Path
from typing import Any, NoReturn, cast

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from mesh.errors import TopologyError
from mesh.types import TIERS, Tier
from mesh.webhooks import parse_prefix
from topology.schema import (
    ISOLATIONS,
    MAX_WEBHOOK_CA,
    MAX_WEBHOOKS,
    QUOTA_KEYS,
    SCHEMA_VERSION,
    Gpu,
    Hardware,
    Isolation,
    Link,
    Site,
    Tenant,
    Topology,
)

__all__ = ["NAME_RE", "load_topology_file", "parse_topology"]

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

_TOP_KEYS = ("schema", "sites", "links", "tenants")
_SITE_KEYS = ("name", "tier", "region", "coordinates", "hardware")
_COORD_KEYS = ("lat", "lon")
_HW_KEYS = ("cpu_cores", "memory_mb", "gpus", "price_per_hour")
_HW_REQUIRED = ("cpu_cores", "memory_mb", "price_per_hour")
_GPU_KEYS = ("model", "memory_mb")
_LINK_KEYS = ("a", "b", "latency_ms", "bandwidth_mbps", "jitter_ms")
_LINK_REQUIRED = ("a", "b", "latency_ms", "bandwidth_mbps")
_TENANT_KEYS = ("name", "isolation", "quotas", "webhooks", "webhook_ca")


def load_topology_file(path: str | Path) -> Topology:
    """Read and validate a topology file. Raises :class:`TopologyError` for anything wrong."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"cannot read file: {exc}", file=str(path)) from exc
    return parse_topology(text, file=str(path))


def parse_topology(text: str, file: str = "<string>") -> Topology:
    """Validate YAML text; ``file`` is only used in error messages."""
    return _Loader(file).load(text)


def _kind(v: Any) -> str:
    if v is None:
        return "nothing"
    if isinstance(v, bool):
        return f"boolean {v}"
    if isinstance(v, str):
        return f"string {v!r}"
    if isinstance(v, int | float):
        return f"number {v}"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return type(v).__name__


class _Loader:
    def __init__(self, file: str) -> None:
        self.file = file

    # -- error helpers -------------------------------------------------------------------------
    def fail(self, msg: str, line: int | None, field: str | None = None) -> NoReturn:
        raise TopologyError(msg, file=self.file, line=line, field=field)

    @staticmethod
    def key_line(m: Any, k: str) -> int:
        return int(m.lc.key(k)[0]) + 1

    @staticmethod
    def val_line(m: Any, k: str) -> int:
        return int(m.lc.value(k)[0]) + 1

    @staticmethod
    def item_line(s: Any, i: int) -> int:
        return int(s.lc.item(i)[0]) + 1

    @staticmethod
    def node_line(n: Any) -> int:
        return int(n.lc.line) + 1

    # -- structural checks ---------------------------------------------------------------------
    def mapping(self, v: Any, line: int, path: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            self.fail(f"expected a mapping, got {_kind(v)}", line, path)
        return v

    def seq(self, v: Any, line: int, path: str) -> list[Any]:
        if not isinstance(v, list):
            self.fail(f"expected a list, got {_kind(v)}", line, path)
        return v

    def keys(self, m: Any, allowed: tuple[str, ...], required: tuple[str, ...], path: str) -> None:
        for k in m:
            if k not in allowed:
                close = difflib.get_close_matches(str(k), allowed, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(allowed)})"
                self.fail(f"unknown key {k!r}{hint}", self.key_line(m, k), f"{path}.{k}" if path else str(k))
        for k in required:
            if k not in m:
                self.fail(f"missing required field {k!r}", self.node_line(m), f"{path}.{k}" if path else k)

    def string(self, m: Any, k: str, path: str) -> str:
        v = m[k]
        if not isinstance(v, str) or not v:
            self.fail(f"expected a non-empty string, got {_kind(v)}", self.val_line(m, k), f"{path}.{k}")
        return v

    def name(self, m: Any, k: str, path: str) -> str:
        v = self.string(m, k, path)
        if not NAME_RE.match(v):
            self.fail(f"invalid name {v!r}: use lowercase letters, digits and '-' (at most 63, "
                      f"not starting or ending with '-')", self.val_line(m, k), f"{path}.{k}")
        return v

    def number(self, m: Any, k: str, path: str, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, integer: bool = False) -> float:
        v = m[k]
        line, where = self.val_line(m, k), f"{path}.{k}"
        want = "an integer" if integer else "a number"
        if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not isinstance(v, int)):
            self.fail(f"expected {want}, got {_kind(v)}", line, where)
        if not math.isfinite(v):
            self.fail(f"expected a finite number, got {v}", line, where)
        if lo is not None and (v <= lo if lo_open else v < lo):
            bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
            self.fail(f"must be {bound}, got {v:g}", line, where)
        if hi is not None and v > hi:
            self.fail(f"must be <= {hi:g}, got {v:g}", line, where)
        return float(v)

    def choice(self, m: Any, k: str, options: tuple[str, ...], path: str) -> str:
        v = m[k]
        if v not in options:
            close = difflib.get_close_matches(str(v), options, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            self.fail(f"invalid value {v!r}: must be one of {', '.join(options)}{hint}",
                      self.val_line(m, k), f"{path}.{k}")
        return str(v)

    # -- document ------------------------------------------------------------------------------
    def load(self, text: str) -> Topology:
        try:
            doc = YAML(typ="rt").load(text)
        except MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else None
            what = " ".join(str(exc.problem or exc.context or "invalid YAML").split())
            self.fail(f"YAML syntax error: {what}", line)
        except YAMLError as exc:
            self.fail(f"YAML syntax error: {exc}", None)
        if not isinstance(doc, dict):
            self.fail(f"top level must be a mapping with keys {', '.join(_TOP_KEYS)}, got {_kind(doc)}", 1)
        self.keys(doc, _TOP_KEYS, (), "")
        if "schema" not in doc:
            self.fail(f"missing schema version (add 'schema: {SCHEMA_VERSION}')", 1, "schema")
        if doc["schema"] != SCHEMA_VERSION or isinstance(doc["schema"], bool):
            self.fail(f"unsupported schema version {doc['schema']!r} (this tiermesh reads {SCHEMA_VERSION})",
                      self.val_line(doc, "schema"), "schema")
        if "sites" not in doc:
            self.fail("missing required field 'sites'", 1, "sites")
        sites_node = self.seq(doc["sites"], self.val_line(doc, "sites"), "sites")
        if not sites_node:
            self.fail("at least one site is required", self.key_line(doc, "sites"), "sites")
        sites: dict[str, Site] = {}
        site_lines: dict[str, tuple[int, int]] = {}
        for i, node in enumerate(sites_node):
            site = self.site(node, self.item_line(sites_node, i), f"sites[{i}]")
            if site.name in sites:
                first = site_lines[site.name][1]
                self.fail(f"duplicate site name {site.name!r} (first defined at line {first})",
                          self.val_line(node, "name"), f"sites[{i}].name")
            sites[site.name] = site
            site_lines[site.name] = (i, self.val_line(node, "name"))
        links: list[Link] = []
        if doc.get("links") is not None:
            links = self.links(self.seq(doc["links"], self.val_line(doc, "links"), "links"), sites)
        tenants: dict[str, Tenant] = {}
        if doc.get("tenants") is not None:
            tnode = self.seq(doc["tenants"], self.val_line(doc, "tenants"), "tenants")
            for i, node in enumerate(tnode):
                t = self.tenant(node, self.item_line(tnode, i), f"tenants[{i}]")
                if t.name in tenants:
                    self.fail(f"duplicate tenant {t.name!r}", self.val_line(node, "name"),
                              f"tenants[{i}].name")
                tenants[t.name] = t
        self.graph_rules(sites, links, site_lines)
        return Topology(sites=sites, links=tuple(links), tenants=tenants, schema=SCHEMA_VERSION)

    def site(self, node: Any, line: int, path: str) -> Site:
        m = self.mapping(node, line, path)
        self.keys(m, _SITE_KEYS, _SITE_KEYS, path)
        name = self.name(m, "name", path)
        tier = self.choice(m, "tier", TIERS, path)
        region = self.string(m, "region", path)
        coords = self.mapping(m["coordinates"], self.val_line(m, "coordinates"), f"{path}.coordinates")
        cpath = f"{path}.coordinates"
        self.keys(coords, _COORD_KEYS, _COORD_KEYS, cpath)
        lat = self.number(coords, "lat", cpath, lo=-90, hi=90)
        lon = self.number(coords, "lon", cpath, lo=-180, hi=180)
        hpath = f"{path}.hardware"
        hw = self.mapping(m["hardware"], self.val_line(m, "hardware"), hpath)
        self.keys(hw, _HW_KEYS, _HW_REQUIRED, hpath)
        cpu = self.number(hw, "cpu_cores", hpath, lo=0, lo_open=True, integer=True)
        mem = self.number(hw, "memory_mb", hpath, lo=0, lo_open=True, integer=True)
        price = self.number(hw, "price_per_hour", hpath, lo=0)
        gpus: list[Gpu] = []
        if hw.get("gpus") is not None:
            gnode = self.seq(hw["gpus"], self.val_line(hw, "gpus"), f"{hpath}.gpus")
            for j, g in enumerate(gnode):
                gpath = f"{hpath}.gpus[{j}]"
                gm = self.mapping(g, self.item_line(gnode, j), gpath)
                self.keys(gm, _GPU_KEYS, _GPU_KEYS, gpath)
                model = self.string(gm, "model", gpath)
                gmem = self.number(gm, "memory_mb", gpath, lo=0, lo_open=True, integer=True)
                gpus.append(Gpu(model=model, memory_mb=int(gmem)))
        hardware = Hardware(cpu_cores=int(cpu), memory_mb=int(mem), gpus=tuple(gpus), price_per_hour=price)
        # choice() has checked the tier is one of TIERS
        return Site(name=name, tier=cast(Tier, tier), region=region, lat=lat, lon=lon, hardware=hardware)

    def links(self, node: list[Any], sites: dict[str, Site]) -> list[Link]:
        out: list[Link] = []
        seen: dict[tuple[str, str], int] = {}
        for i, item in enumerate(node):
            path = f"links[{i}]"
            m = self.mapping(item, self.item_line(node, i), path)
            self.keys(m, _LINK_KEYS, _LINK_REQUIRED, path)
            ends = []
            for k in ("a", "b"):
                v = self.string(m, k, path)
                if v not in sites:
                    close = difflib.get_close_matches(v, list(sites), n=1, cutoff=0.6)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    self.fail(f"link to unknown site {v!r}{hint}", self.val_line(m, k), f"{path}.{k}")
                ends.append(v)
            a, b = ends
            if a == b:
                self.fail(f"self-link: both ends are {a!r}", self.val_line(m, "b"), f"{path}.b")
            key = (min(a, b), max(a, b))
            if key in seen:
                self.fail(f"duplicate link between {key[0]!r} and {key[1]!r} (first defined at line "
                          f"{seen[key]})", self.node_line(m), path)
            seen[key] = self.node_line(m)
            if sites[a].tier == "edge" and sites[b].tier == "edge":
                self.fail(f"edge-to-edge link {a!r} - {b!r} is not allowed: edge sites connect through "
                          f"a middle or core site", self.node_line(m), path)
            lat = self.number(m, "latency_ms", path, lo=0)
            bw = self.number(m, "bandwidth_mbps", path, lo=0, lo_open=True)
            jit = self.number(m, "jitter_ms", path, lo=0) if "jitter_ms" in m else 0.0
            out.append(Link(a=a, b=b, latency_ms=lat, bandwidth_mbps=bw, jitter_ms=jit))
        return out

    def tenant(self, node: Any, line: int, path: str) -> Tenant:
        m = self.mapping(node, line, path)
        self.keys(m, _TENANT_KEYS, ("name",), path)
        name = self.name(m, "name", path)
        iso: Isolation = "shared"
        if "isolation" in m:
            iso = "strict" if self.choice(m, "isolation", ISOLATIONS, path) == "strict" else "shared"
        quotas: dict[str, float] = {}
        if m.get("quotas") is not None:
            qpath = f"{path}.quotas"
            q = self.mapping(m["quotas"], self.val_line(m, "quotas"), qpath)
            self.keys(q, QUOTA_KEYS, (), qpath)
            for k in q:
                quotas[str(k)] = self.number(q, k, qpath, lo=0)
        hooks = self.webhooks(m, path) if m.get("webhooks") is not None else ()
        ca = self.webhook_ca(m, path) if "webhook_ca" in m else None
        return Tenant(name=name, isolation=iso, quotas=quotas, webhooks=hooks, webhook_ca=ca)

    def webhooks(self, m: Any, path: str) -> tuple[str, ...]:
        wpath = f"{path}.webhooks"
        node = self.seq(m["webhooks"], self.val_line(m, "webhooks"), wpath)
        if len(node) > MAX_WEBHOOKS:
            self.fail(f"at most {MAX_WEBHOOKS} webhook prefixes per tenant, got {len(node)}",
                      self.val_line(m, "webhooks"), wpath)
        out: list[str] = []
        for j, raw in enumerate(node):
            line = self.item_line(node, j)
            try:
                text = parse_prefix(raw).text
            except ValueError as exc:
                self.fail(str(exc), line, f"{wpath}[{j}]")
            if text in out:
                self.fail(f"duplicate webhook prefix {text!r}", line, f"{wpath}[{j}]")
            out.append(text)
        return tuple(out)

    def webhook_ca(self, m: Any, path: str) -> str:
        """The PEM of the file ``webhook_ca`` names, checked to hold CA certificates ``ssl`` can load."""
        raw = self.string(m, "webhook_ca", path)
        line, where = self.val_line(m, "webhook_ca"), f"{path}.webhook_ca"
        p = Path(raw)
        if not p.is_absolute() and self.file != "<string>":
            p = Path(self.file).parent / p
        try:
            pem = p.read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as exc:
            self.fail(f"cannot read the CA bundle {str(p)!r}: {exc}", line, where)
        if len(pem) > MAX_WEBHOOK_CA:
            self.fail(f"the CA bundle {str(p)!r} is over {MAX_WEBHOOK_CA} characters", line, where)
        try:
            ssl.create_default_context(cadata=pem)
        except (ssl.SSLError, ValueError) as exc:
            self.fail(f"{str(p)!r} holds no usable PEM CA certificate: {exc}", line, where)
        return pem

    def graph_rules(self, sites: dict[str, Site], links: list[Link],
                    site_lines: dict[str, tuple[int, int]]) -> None:
        neighbours: dict[str, set[str]] = {n: set() for n in sites}
        for lk in links:
            neighbours[lk.a].add(lk.b)
            neighbours[lk.b].add(lk.a)
        for name, site in sites.items():
            if site.tier != "edge":
                continue
            if not any(sites[n].tier in ("middle", "core") for n in neighbours[name]):
                i, line = site_lines[name]
                self.fail(f"edge site {name!r} has no link to a middle or core site", line, f"sites[{i}]")
        comps = _components(neighbours)
        if len(comps) <= 1:
            return
        # The main component is the one holding a core site (else the biggest); report others.
        comps.sort(key=len, reverse=True)
        main = next((c for c in comps if any(sites[n].tier == "core" for n in c)), comps[0])
        stray = min((n for n in sites if n not in main), key=lambda n: site_lines[n][0])
        i, line = site_lines[stray]
        self.fail(f"site {stray!r} is not reachable from the other sites (add a link)", line, f"sites[{i}]")


def _components(neighbours: dict[str, set[str]]) -> list[set[str]]:
    """Connected components, in the order their first site appears (a plain walk: the loader
    needs reachability, not paths, and a topology has a few dozen sites)."""
    seen: set[str] = set()
    comps: list[set[str]] = []
    for start in neighbours:
        if start in seen:
            continue
        comp = {start}
        todo = [start]
        while todo:
            for n in neighbours[todo.pop()]:
                if n not in comp:
                    comp.add(n)
                    todo.append(n)
        seen |= comp
        comps.append(comp)
    return comps
