"""Failure drills of ``tiermesh up``: what ``--kill SITE@S``, ``--cut A-B@S`` and ``--blackhole A-B@S``
mean, parsed once, and what the report says about each link drill afterwards.

Site names contain hyphens (``mid-eu``), so ``A-B`` is split where both sides are sites of the
topology; a spec that splits no way or two ways is refused with the sites listed.

A link drill's report, over the queries sent from ``at_s`` on (times are the workload's own clock):

- ``after``: how many; ``errors`` by code; ``past_deadline_1s``: answered (or failed) more than
  1 s after the caller's latency budget, i.e. hung; ``lost`` is the run's count of queries never
  answered at all (the workload's bounded wait gave up on them);
- ``crossing_before`` / ``crossing_after``: queries served at a site whose path from their edge
  crosses the failed link (``crossing_after`` counts the ones that still did, i.e. sent before the
  failure was noticed, or over a link that still worked for them);
- ``routed_around``: after the drill, queries from (edge, SLO class) pairs that crossed the link
  before it and were now served without crossing it;
- ``detection_s``: from the drill to the first such query served without crossing the link: how
  long the mesh took to notice and route around (None when none was);
- ``affected_misses`` / ``last_miss_s``: how many such queries failed or missed their budget, and
  when the last one was sent after the drill (0 when none did); a late one can be ordinary noise
  rather than the dead link, so read it with ``affected_misses``.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mesh.errors import ConfigError
from tiermesh.workload import QueryRecord
from topology.paths import topology_paths
from topology.schema import Topology

__all__ = ["LinkDrill", "crosses_link", "drill_report", "parse_kill", "parse_link_drill"]

Kind = Literal["cut", "blackhole"]


@dataclass(frozen=True, slots=True)
class LinkDrill:
    kind: Kind
    a: str
    b: str
    at_s: float

    @property
    def link(self) -> str:
        return f"{self.a}-{self.b}"


def _seconds(spec: str, at: str, flag: str, form: str) -> float:
    try:
        value = float(at)
    except ValueError:
        raise ConfigError(f"{flag} wants {form}, got {spec!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{flag} {spec!r}: the time must be a number of seconds >= 0")
    return value


def parse_kill(spec: str | None) -> tuple[str, float] | None:
    if not spec:
        return None
    site, sep, at = spec.rpartition("@")
    if not sep or not site:
        raise ConfigError(f"--kill wants SITE@SECONDS, got {spec!r}")
    return site, _seconds(spec, at, "--kill", "SITE@SECONDS")


def parse_link_drill(kind: Kind, spec: str, sites: Collection[str]) -> LinkDrill:
    """``A-B@SECONDS`` with ``A`` and ``B`` two different sites of ``sites``."""
    flag, form = f"--{kind}", "A-B@SECONDS (two site names and a time)"
    link, sep, at = spec.rpartition("@")
    if not sep or not link:
        raise ConfigError(f"{flag} wants {form}, got {spec!r}")
    seconds = _seconds(spec, at, flag, form)
    splits = [(link[:i], link[i + 1:]) for i, ch in enumerate(link) if ch == "-"]
    fits = [(a, b) for a, b in splits if a in sites and b in sites]
    if not fits:
        raise ConfigError(f"{flag} {spec!r}: {link!r} is not two sites joined by '-' "
                          f"(sites: {', '.join(sorted(sites))})")
    if len(fits) > 1:
        raise ConfigError(f"{flag} {spec!r}: {link!r} splits into sites more than one way: {fits}")
    a, b = fits[0]
    if a == b:
        raise ConfigError(f"{flag} {spec!r}: a link joins two different sites")
    return LinkDrill(kind, a, b, seconds)


def crosses_link(topology: Topology, a: str, b: str) -> Callable[[str, str], bool]:
    """``crosses(src, dst)``: does the planned path from ``src`` to ``dst`` (:mod:`topology.paths`,
    the one the delay proxies shape) use the link ``a``-``b``? When the topology has no such link,
    the drill is about the pair itself: true for ``{src, dst} == {a, b}`` only."""
    paths = topology_paths(topology)
    linked = any(set(lk.ends) == {a, b} for lk in topology.links)

    def crosses(src: str, dst: str) -> bool:
        if not dst or src == dst or src not in topology.sites or dst not in topology.sites:
            return False
        if not linked:
            return {src, dst} == {a, b}
        return any({x, y} == {a, b} for x, y in itertools.pairwise(paths.path(src, dst)))
    return crosses


def drill_report(drill: LinkDrill, records: Sequence[QueryRecord], crosses: Callable[[str, str], bool],
                 *, lost: int, failed_pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """The drill's section of the report (see the module docstring). ``crosses(edge, site)``: does
    the path from ``edge`` to ``site`` use the failed link."""
    before = [r for r in records if r.t < drill.at_s]
    after = [r for r in records if r.t >= drill.at_s]
    used = {(r.edge, r.slo_class) for r in before if r.ok and crosses(r.edge, r.site)}
    affected = [r for r in after if (r.edge, r.slo_class) in used]
    bad = [r for r in affected if not r.ok or r.total_ms > r.budget_ms]
    around = [r for r in affected if r.ok and not crosses(r.edge, r.site)]
    return {
        "kind": drill.kind, "link": drill.link, "at_s": drill.at_s,
        "failed_paths": [f"{s}->{d}" for s, d in failed_pairs],
        "after": len(after),
        "errors": dict(Counter(r.error for r in after if not r.ok)),
        "past_deadline_1s": sum(1 for r in after if r.client_ms > r.budget_ms + 1000.0),
        "lost": lost,
        "crossing_before": sum(1 for r in before if r.ok and crosses(r.edge, r.site)),
        "crossing_after": sum(1 for r in after if r.ok and crosses(r.edge, r.site)),
        "routed_around": len(around),
        "detection_s": min((round(r.t - drill.at_s, 3) for r in around), default=None),
        "affected_misses": len(bad),
        "last_miss_s": round(max((r.t - drill.at_s for r in bad), default=0.0), 3),
    }
