"""The etcd key space of DESIGN.md, relative to the Store prefix (default ``/tiermesh/``).

Only pure string helpers: every module that reads or writes etcd builds its keys through these,
and every reader of a whole prefix sorts keys back into their kinds with :func:`parse_key`, so
the layout lives in one place.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "BUILDS",
    "BUILD_STATE",
    "CASCADES",
    "CATALOG",
    "ELECTION_SCHEDULER",
    "EVENTS_PLACEMENT",
    "FORECAST_STATE",
    "JOBS",
    "JOBS_BY_TENANT",
    "JOBS_DEDUP",
    "JOBS_LIVE",
    "JOB_ASSIGN",
    "LINKS",
    "LIVE",
    "MODELS",
    "MODEL_OPS",
    "PIPELINES",
    "PKI",
    "PKI_CRL",
    "PKI_SITES",
    "PLACEMENT",
    "SERVICES",
    "SITES",
    "TASK_NAME",
    "TENANTS",
    "TOPOLOGY_LAST_APPLY",
    "TOPOLOGY_META",
    "VERSIONS",
    "KeyKind",
    "assign_key",
    "blobs_key",
    "build_key",
    "build_state_key",
    "build_tenant_prefix",
    "cascade_key",
    "catalog_key",
    "chunk_key",
    "claim_key",
    "job_dedup_key",
    "job_key",
    "job_live_key",
    "job_notify_key",
    "job_prefix",
    "job_tenant_key",
    "job_tenant_prefix",
    "last_segment",
    "link_key",
    "live_key",
    "model_key",
    "model_op_key",
    "parse_key",
    "pipeline_key",
    "placement_key",
    "site_cert_key",
    "site_key",
    "task_key",
    "tenant_key",
    "version_key",
]

SITES = "topology/sites/"
LINKS = "topology/links/"
TENANTS = "tenants/"
CATALOG = "catalog/"
# cascades/<task>/<cascade id>: a task's calibrated cascades (variant_store.cascade_meta), written where the catalog is
CASCADES = "cascades/"
# pipelines/<task>: a task declared as a graph of other tasks (variant_store.pipeline_meta), written as cascades are
PIPELINES = "pipelines/"
LIVE = "live/"
PLACEMENT = "placement/"
MODELS = "models/"
SERVICES = "services/"
PKI = "pki/"
PKI_CRL = PKI + "crl"  # the CA-signed revocation list (PEM), published by `tiermesh pki revoke`
# every site's certificate (public), written by the site itself or `tiermesh pki issue`: how peers learn the CURVE
# key to admit and dial. Trusted only when the CA vouches for it (mesh.zmq.curve.SiteKeys); etcd only delivers
PKI_SITES = PKI + "sites/"
TOPOLOGY_META = "topology/meta"
# what the last topology apply that changed something changed (for the console): written in its txn
TOPOLOGY_LAST_APPLY = "topology/last_apply"
ELECTION_SCHEDULER = "election/scheduler"
EVENTS_PLACEMENT = "events/placement"
# the scheduler leader's forecast state (a head key and its chunks below it), under events/ because that
# is a prefix the scheduler may write (mesh.etcd.rbac); no view follows it, only a new leader reads it
FORECAST_STATE = "events/forecast"
# offline jobs (edge_agent.jobs_api, edge_agent.chunks): jobs/<id>/job (the record), jobs/<id>/chunks/<n> (each
# chunk's state and output digest), jobs/<id>/claims/<n> (who works on it, under that site's lease). Never payloads
JOBS = "jobs/"
# jobs/dedup/<tenant>/<fingerprint>: the id of the last job admitted for that input and request (a hint a door
# checks against the job's own record before answering a resubmission with it; mesh.jobspec.dedup_fingerprint)
JOBS_DEDUP = JOBS + "dedup/"
# record copies, written in the same txns as the record (core_scheduler.state.jobs), so a list reads records and never
# a chunk: jobs/live/<id> while the job is queued or running (what chunk workers poll; a chunk commits only while it
# exists), jobs/tenant/<tenant>/<id> for every job until retention removes it (what the job API lists)
JOBS_LIVE = JOBS + "live/"
JOBS_BY_TENANT = JOBS + "tenant/"
# jobassign/<id>/<n>: the scheduler leader's assignment of chunk n of a job to a site, which also lets that site
# fetch the job's variant from the variant store (variant_store.job_grants). Outside jobs/ on purpose: sites write
# jobs/, and only the scheduler may write this (mesh.etcd.rbac), so a site cannot assign itself another's variant
JOB_ASSIGN = "jobassign/"
# tenants' model builds (issue 34; edge_agent.models_api, variant_store.tenant_builds), split by writer so that a site
# cannot forge a finished build: builds/<tenant>/<id> is the request a door wrote (sites write builds/), and
# buildstate/<id> its state, progress and results, which only the variant store writes (mesh.etcd.rbac)
BUILDS = "builds/"
BUILD_STATE = "buildstate/"
# versions/<task>: a tenant task's versions, the active one and the traffic split (variant_store.versions): the store's
VERSIONS = "versions/"
# modelops/<tenant>/<id>: a door's request to the store to split a task's traffic or delete it, and the store's answer
MODEL_OPS = "modelops/"
TASK_NAME = "_task"  # catalog/<task>/_task holds the task's signature: never a variant id
_BLOBS = SERVICES + "variant-store"


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



def tenant_key(name: str) -> str:
    return TENANTS + _segment("tenant", name)


def catalog_key(task: str, variant: str) -> str:
    return f"{CATALOG}{_segment('task', task)}/{_segment('variant', variant)}"


def cascade_key(task: str, cascade_id: str | None = None) -> str:
    """A calibrated cascade of ``task``'s variants (``variant_store.cascade_meta``); without an id, the task's
    cascades' prefix."""
    base = f"{CASCADES}{_segment('task', task)}/"
    return base if cascade_id is None else base + _segment("cascade", cascade_id)


def pipeline_key(task: str | None = None) -> str:
    """A task declared as a graph of other tasks (``variant_store.pipeline_meta``); without a task, the prefix."""
    return PIPELINES if task is None else PIPELINES + _segment("task", task)


def task_key(task: str) -> str:
    """Where the task's signature lives, beside its variants."""
    return catalog_key(task, TASK_NAME)


def model_key(task: str, family: str) -> str:
    """A registered model (the parent the variants are generated from)."""
    return f"{MODELS}{_segment('task', task)}/{_segment('family', family)}"



def site_cert_key(site: str) -> str:
    """Where ``site``'s certificate is published (``{"schema": 1, "pem": ...}``, :mod:`mesh.pki.published`)."""
    return PKI_SITES + _segment("site", site)


def live_key(site: str) -> str:
    return LIVE + _segment("site", site)


def placement_key(site: str) -> str:
    return PLACEMENT + _segment("site", site)


def blobs_key() -> str:
    """Where the variant store announces the URL of its blob HTTP server."""
    return _BLOBS


def job_key(job_id: str) -> str:
    """An offline job's record."""
    return f"{JOBS}{_segment('job', job_id)}/job"


def job_prefix(job_id: str) -> str:
    """Every key of one job (its record, chunks and claims): what a follower of the job watches."""
    return f"{JOBS}{_segment('job', job_id)}/"


def job_dedup_key(tenant: str, fingerprint: str) -> str:
    """The resubmission index entry of ``tenant``'s job for one input and request (``dedup_fingerprint``)."""
    return f"{JOBS_DEDUP}{_segment('tenant', tenant)}/{_segment('fingerprint', fingerprint)}"


def job_live_key(job_id: str) -> str:
    """The copy of a job's record that says it is live (queued or running)."""
    return JOBS_LIVE + _segment("job", job_id)


def job_tenant_prefix(tenant: str) -> str:
    """Every job record copy of ``tenant`` (its job list)."""
    return f"{JOBS_BY_TENANT}{_segment('tenant', tenant)}/"


def job_tenant_key(tenant: str, job_id: str) -> str:
    """The copy of a job's record in its tenant's list."""
    return job_tenant_prefix(tenant) + _segment("job", job_id)


def chunk_key(job_id: str, index: int) -> str:
    """Chunk ``index`` of a job (zero-padded, so a prefix read returns chunks in order)."""
    if index < 0:
        raise ValueError(f"a chunk index is >= 0, got {index}")
    return f"{JOBS}{_segment('job', job_id)}/chunks/{index:06d}"


def claim_key(job_id: str, index: int) -> str:
    """Who holds chunk ``index`` of a job now (written under the worker's lease: it vanishes with the site)."""
    if index < 0:
        raise ValueError(f"a chunk index is >= 0, got {index}")
    return f"{JOBS}{_segment('job', job_id)}/claims/{index:06d}"


def assign_key(job_id: str, index: int | None = None) -> str:
    """Which site the scheduler leader handed chunk ``index`` of a job to (``core_scheduler.state.job_assign``),
    under :data:`JOB_ASSIGN`; without an index, the prefix of all the job's assignments."""
    if index is None:
        return f"{JOB_ASSIGN}{_segment('job', job_id)}/"
    if index < 0:
        raise ValueError(f"a chunk index is >= 0, got {index}")
    return f"{JOB_ASSIGN}{_segment('job', job_id)}/{index:06d}"


def job_notify_key(job_id: str, *, claim: bool = False) -> str:
    """A job's notification: ``jobs/<id>/notified`` (what became of it, created once: a new leader never sends what
    was delivered), or with ``claim`` ``jobs/<id>/notifying`` (the sender now, under its lease)."""
    return f"{JOBS}{_segment('job', job_id)}/{'notifying' if claim else 'notified'}"


def build_tenant_prefix(tenant: str) -> str:
    """Every build request of ``tenant`` (its build list)."""
    return f"{BUILDS}{_segment('tenant', tenant)}/"


def build_key(tenant: str, build_id: str) -> str:
    """A tenant's build request, written once by the door that admitted it."""
    return build_tenant_prefix(tenant) + _segment("build", build_id)


def build_state_key(build_id: str) -> str:
    """A build's state, progress and results: the variant store's alone to write."""
    return BUILD_STATE + _segment("build", build_id)


def version_key(task: str) -> str:
    """A tenant task's version record (``variant_store.versions``): the variant store's alone to write."""
    return VERSIONS + _segment("task", task)


def model_op_key(tenant: str, op_id: str | None = None) -> str:
    """A door's traffic or delete request for ``tenant`` (``variant_store.versions``); without an id, the prefix."""
    base = MODEL_OPS + _segment("tenant", tenant) + "/"
    return base if op_id is None else base + _segment("op", op_id)


def last_segment(key: str) -> str:
    """``live/edge-1`` -> ``edge-1``: the name part of a one-level key (sites, tenants, live, ...)."""
    return key.rstrip("/").rsplit("/", 1)[-1]


KeyKind = Literal["site", "link", "tenant", "task", "variant", "live", "placement", "service", "crl", "site_cert"]
_ONE_LEVEL: dict[str, KeyKind] = {TENANTS[:-1]: "tenant", LIVE[:-1]: "live", PLACEMENT[:-1]: "placement"}


def parse_key(key: str) -> tuple[KeyKind, tuple[str, ...]] | None:
    """The kind of a key and the names in it, e.g. ``live/edge-1`` -> ``("live", ("edge-1",))``,
    ``catalog/t/_task`` -> ``("task", ("t",))``, ``services/variant-store`` ->
    ``("service", ("variant-store",))``, ``pki/crl`` -> ``("crl", ())``, ``pki/sites/edge-1`` ->
    ``("site_cert", ("edge-1",))``; ``None`` for keys no view follows
    (meta, models, events, election, the rest of pki) and for malformed ones."""
    if key == PKI_CRL:
        return "crl", ()
    head, _, rest = key.partition("/")
    parts = tuple(rest.split("/")) if rest else ()
    if not all(parts):
        return None
    if head == "pki" and len(parts) == 2 and parts[0] == "sites":
        return "site_cert", parts[1:]
    if head == "topology" and len(parts) >= 2:
        kind, names = parts[0], parts[1:]
        if kind == "sites" and len(names) == 1:
            return "site", names
        if kind == "links" and len(names) == 2:
            return "link", names
        return None
    if head == "catalog" and len(parts) == 2:
        return ("task", parts[:1]) if parts[1] == TASK_NAME else ("variant", parts)
    if len(parts) == 1 and head in _ONE_LEVEL:
        return _ONE_LEVEL[head], parts
    if head == "services" and parts:
        return "service", ("/".join(parts),)
    return None
