"""Membership drills of ``tiermesh up``: a machine added to the mesh (``--join SITE@S``) and one taken out by
revoking its certificate (``--revoke SITE@S``), each at a time into the workload, as an operator does it
(:mod:`tiermesh.lab_hosts`: apply the topology with the site, ``tiermesh pki issue --site S --address HOST``, copy its
files to its host, start ``tiermesh agent`` there; ``tiermesh pki revoke --site S``). Parsed once here, and reported
from the workload's records afterwards.

A join's report: when the site's agent was up (``ready_s`` after the join), the first query it served
(``first_served_s``, None if none) and how many it served. A revoke's report: queries served at the site in the
``REVOKE_GRACE_S`` before the revoke (it was serving), after the revoke and from ``REVOKE_GRACE_S`` after it (the
promise: none), when the last one was, how many queries the site ran for its peers
(``tiermesh_served_total{role="forwarded"}`` read from its own ``/metrics``) from then to the end of the run (none),
and the errors of queries sent after the revoke.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mesh.errors import ConfigError
from tiermesh.drills import parse_kill
from tiermesh.workload import QueryRecord

__all__ = ["REVOKE_GRACE_S", "MembershipDrill", "check_drills", "membership_report", "parse_membership"]

Kind = Literal["join", "revoke"]
REVOKE_GRACE_S = 5.0  # a revoked site is out of every peer within this (issue 28's promise)


@dataclass(frozen=True, slots=True)
class MembershipDrill:
    kind: Kind
    site: str
    at_s: float


def parse_membership(kind: Kind, spec: str, sites: Collection[str]) -> MembershipDrill:
    """``SITE@SECONDS``, the site one of ``sites``."""
    parsed = parse_kill(spec)
    if parsed is None:
        raise ConfigError(f"--{kind} wants SITE@SECONDS, got {spec!r}")
    site, at = parsed
    if site not in sites:
        raise ConfigError(f"--{kind} {spec!r}: {site!r} is not a site of the topology "
                          f"(sites: {', '.join(sorted(sites))})")
    return MembershipDrill(kind, site, at)


def check_drills(drills: Sequence[MembershipDrill], started: Collection[str]) -> None:
    """A site joins once, and is not running before; a revoked site is one that runs by then."""
    joins = [d.site for d in drills if d.kind == "join"]
    if len(set(joins)) != len(joins):
        raise ConfigError(f"--join names a site twice: {sorted(joins)}")
    for d in drills:
        if d.kind == "revoke" and d.site not in started and d.site not in joins:
            raise ConfigError(f"--revoke {d.site}@{d.at_s:g}: that site is not running")
        if d.kind == "revoke" and d.site in joins and next(j.at_s for j in drills if j.site == d.site
                                                            and j.kind == "join") >= d.at_s:
            raise ConfigError(f"--revoke {d.site}@{d.at_s:g}: it joins only later")


def membership_report(drill: MembershipDrill, records: Sequence[QueryRecord], *, ready_s: float | None = None,
                      forwarded_after_grace: int | None = None) -> dict[str, Any]:
    """What the records (and the site's own counters) say about one drill; times from the drill."""
    at = drill.at_s
    served = sorted(r.t - at for r in records if r.ok and r.site == drill.site and r.t >= at)
    out: dict[str, Any] = {"kind": drill.kind, "site": drill.site, "at_s": at}
    if drill.kind == "join":
        out |= {"ready_s": None if ready_s is None else round(ready_s, 3),
                "first_served_s": round(served[0], 3) if served else None, "served": len(served)}
        return out
    after = [r for r in records if r.t >= at]
    before = [r for r in records if r.ok and r.site == drill.site and at - REVOKE_GRACE_S <= r.t < at]
    out |= {"served_before": len(before),
            "served_after": len(served),
            "served_from_grace": sum(1 for t in served if t >= REVOKE_GRACE_S),
            "last_served_s": round(served[-1], 3) if served else None,
            "forwarded_to_it_from_grace": forwarded_after_grace,
            "queries_after": len(after),
            "errors_after": dict(Counter(r.error for r in after if r.error))}
    return out
