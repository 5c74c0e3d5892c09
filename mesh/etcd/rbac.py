"""etcd RBAC for a mesh: who may read and write which keys, as pure data (:func:`plan`), and applying it
to an etcd cluster (:func:`apply`).

With ``--client-cert-auth`` etcd takes the client certificate's subject CN as the user name, and the mesh
CA writes ``<kind>:<name>`` there (:attr:`mesh.pki.identity.Identity.common_name`), so the users here are
named after identities and have no password. Roles (all relative to the store prefix ``P``):

- ``site:<S>`` (an agent): read everything under ``P``; write only ``P live/<S>`` (its heartbeat),
  ``P pki/sites/<S>`` (its own certificate, public: peers believe it only if the CA signed it) and ``P jobs/``
  (offline jobs: a door writes the records of the jobs it admitted, every site claims and commits chunks. Any site
  may write any job's keys: narrowing that to a job's door and a chunk's lease holder is not built yet), and
  ``P builds/`` (a door writes the model build requests it admitted; never ``P buildstate/``) and ``P modelops/``
  (a door's traffic split or delete of a tenant's task, which the store checks and applies). Never
  ``P jobassign/``: a chunk's assignment there lets its site fetch the job's private variant from the variant
  store (:mod:`variant_store.job_grants`), so a site that could write it could grant itself any tenant's variant.
- ``scheduler:<N>``: read everything under ``P``; write ``placement/``, ``events/``, ``election/``, ``jobs/`` and
  ``jobassign/`` (the leader's chunk assignments).
- ``store:<N>`` (the variant store): read everything under ``P``; write ``catalog/``, ``cascades/``,
  ``pipelines/``, ``models/``
  (what it builds), ``services/`` (its announcement), ``buildstate/`` (tenants' model builds it runs: a
  site that could write there could mark a build done with results nobody measured), ``versions/`` (tenants'
  active versions and splits) and ``modelops/`` (its answers to doors' requests).
- ``admin:<N>`` (operators): read everything under ``P``; write ``topology/``, ``tenants/``, ``catalog/``,
  ``cascades/``, ``pipelines/``, ``models/``, ``pki/`` and ``services/``.
- ``root_admins`` (the admin identities that apply this plan; at least one): etcd's ``root`` role, which
  user and role management, ``auth enable`` and compaction need.
- ``crl_followers`` (any identity, usually etcd's own certificate ``etcd:etcd``): read ``P pki/crl``
  and nothing else: all ``tiermesh pki follow-crl`` needs to keep etcd's ``--client-crl-file`` current. Such
  a user may not count the prefix as :meth:`Store.connect <mesh.etcd.store.Store.connect>` does, so it
  connects with ``probe=PKI_CRL``.
- tenants: no etcd user at all, so etcd refuses everything they ask (permission denied).

:func:`apply` is idempotent (existing users and roles are kept; permissions are granted again) and ends
with ``auth enable``. Run it as a root admin's certificate: before auth is enabled anyone may manage
users; after, only a user with the ``root`` role may.

:func:`cut_off` is the other direction, for ``tiermesh pki revoke``: etcd checks a client certificate against
``--client-crl-file`` only at the TLS handshake, so a revoked identity's open connections keep working until
they end. Taking its user's roles away makes etcd refuse every request on them at once (unary requests; an
open watch stream keeps delivering and a lease keep-alive keeps its lease: measured on 3.5.1, which is why the
CRL follower also ends those connections), and revoking a site's ``live/<site>`` lease drops its heartbeat now.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from mesh.backoff import Backoff
from mesh.errors import ConfigError, StoreError, StoreUnavailable
from mesh.etcd import messages as rpc
from mesh.etcd.channels import StorePermissionDenied
from mesh.etcd.keys import (
    BUILD_STATE,
    BUILDS,
    CASCADES,
    CATALOG,
    ELECTION_SCHEDULER,
    EVENTS_PLACEMENT,
    JOB_ASSIGN,
    JOBS,
    MODEL_OPS,
    MODELS,
    PIPELINES,
    PKI,
    PKI_CRL,
    PLACEMENT,
    SERVICES,
    TENANTS,
    VERSIONS,
    live_key,
    site_cert_key,
)
from mesh.etcd.store import Store
from mesh.etcd.wire import prefix_end
from mesh.pki.identity import Identity

__all__ = ["CRL_FOLLOWER_ROLE", "ROOT_ROLE", "ROOT_USER", "CutOff", "Grant", "RbacPlan", "apply",
           "cut_off", "grant_site", "plan", "site_role"]

ROOT_ROLE = "root"
ROOT_USER = "root"  # etcd refuses `auth enable` unless a user named root with the root role exists
CRL_FOLLOWER_ROLE = "tiermesh-crl-follower"
Access = Literal["read", "write", "readwrite"]
_PERM = {"read": rpc.Permission.READ, "write": rpc.Permission.WRITE, "readwrite": rpc.Permission.READWRITE}
OPERATOR_WRITES = ("topology/", TENANTS, CATALOG, CASCADES, PIPELINES, MODELS, PKI, SERVICES)
STORE_WRITES = (CATALOG, CASCADES, PIPELINES, MODELS, SERVICES, BUILD_STATE, VERSIONS, MODEL_OPS)
SCHEDULER_WRITES = (PLACEMENT, EVENTS_PLACEMENT.split("/")[0] + "/", ELECTION_SCHEDULER.split("/")[0] + "/", JOBS,
                    JOB_ASSIGN)


@dataclass(frozen=True, slots=True, order=True)
class Grant:
    """``access`` to ``key`` (an absolute etcd key); with ``prefix`` to every key starting with it."""

    key: str
    access: Access
    prefix: bool

    def permission(self) -> Any:
        k = self.key.encode()
        end = prefix_end(k) if self.prefix else b""
        return rpc.Permission(permType=_PERM[self.access], key=k, range_end=end)


@dataclass(frozen=True, slots=True)
class RbacPlan:
    """Roles (name -> grants) and users (name -> role names) to create in etcd."""

    prefix: str
    roles: Mapping[str, tuple[Grant, ...]] = field(default_factory=dict)
    users: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def may(self, user: str, access: Literal["read", "write"], key: str) -> bool:
        """Whether ``user`` may ``access`` the absolute ``key`` under this plan (for tests and ``--dry-run``)."""
        roles = self.users.get(user, ())
        if ROOT_ROLE in roles:
            return True
        return any((g.access == access or g.access == "readwrite")
                   and (key.startswith(g.key) if g.prefix else key == g.key)
                   for r in roles for g in self.roles.get(r, ()))


def site_role(prefix: str, site: Identity) -> tuple[str, tuple[Grant, ...]]:
    """A site's role: read everything under ``prefix``, write its own heartbeat, its own certificate and jobs."""
    return f"tiermesh-{site.common_name}", (Grant(prefix, "read", True),
                                            Grant(prefix + live_key(site.name), "write", False),
                                            Grant(prefix + site_cert_key(site.name), "write", False),
                                            Grant(prefix + JOBS, "write", True),
                                            Grant(prefix + BUILDS, "write", True),
                                            Grant(prefix + MODEL_OPS, "write", True))


async def grant_site(store: Store, site: str) -> str:
    """Give site ``site`` its etcd user and role (a machine added to a running mesh; a site issued again after a
    revocation took its roles), idempotently, without touching anyone else's. Returns the role.
    ``StorePermissionDenied`` unless ``store`` speaks as a root admin."""
    me = Identity("site", site)
    role, grants = site_role(store.prefix, me)
    await apply(store, RbacPlan(store.prefix, {role: grants}, {me.common_name: (role,)}), enable=False)
    return role


def _names(kind: str, names: Iterable[str]) -> list[Identity]:
    return sorted({Identity(kind, n) for n in names})  # type: ignore[arg-type]  # Identity checks the kind


def plan(prefix: str, *, sites: Iterable[str], schedulers: Iterable[str] = (), admins: Iterable[str] = (),
         root_admins: Iterable[str], stores: Iterable[str] = (), crl_followers: Iterable[Identity] = ()) -> RbacPlan:
    """The RBAC plan for a mesh under ``prefix``. Names are identity names (``edge-1``), not CNs;
    ``crl_followers`` are whole identities (any kind; usually etcd's own, of kind ``etcd``)."""
    if not prefix.startswith("/") or not prefix.endswith("/") or prefix == "/":
        raise ConfigError(f"an RBAC prefix must start and end with '/' and not be '/': {prefix!r}")
    roots = _names("admin", root_admins)
    if not roots:
        raise ConfigError("RBAC needs at least one root admin (the identity that applies it and manages etcd)")
    roles: dict[str, tuple[Grant, ...]] = {ROOT_ROLE: ()}  # etcd's built-in superuser role, created empty
    users: dict[str, tuple[str, ...]] = {ROOT_USER: (ROOT_ROLE,)}
    read_all = Grant(prefix, "read", True)
    for site in _names("site", sites):
        role, grants = site_role(prefix, site)
        roles[role] = grants
        users[site.common_name] = (role,)
    sched_role = "tiermesh-scheduler"
    roles[sched_role] = (read_all, *(Grant(prefix + k, "write", True) for k in SCHEDULER_WRITES))
    for s in _names("scheduler", schedulers):
        users[s.common_name] = (sched_role,)
    store_role = "tiermesh-store"
    roles[store_role] = (read_all, *(Grant(prefix + k, "write", True) for k in STORE_WRITES))
    for v in _names("store", stores):
        users[v.common_name] = (store_role,)
    op_role = "tiermesh-operator"
    roles[op_role] = (read_all, *(Grant(prefix + k, "write", True) for k in OPERATOR_WRITES))
    for a in _names("admin", admins):
        users[a.common_name] = (op_role,)
    for a in roots:
        users[a.common_name] = (ROOT_ROLE, op_role)
    followers = sorted(set(crl_followers))
    if followers:
        roles[CRL_FOLLOWER_ROLE] = (Grant(prefix + PKI_CRL, "read", False),)
    for f in followers:  # added to what the identity has already, should it be in the plan otherwise too
        users[f.common_name] = (*users.get(f.common_name, ()), CRL_FOLLOWER_ROLE)
    return RbacPlan(prefix, roles, users)


def _exists(exc: StoreError) -> bool:
    return "already exists" in str(exc) or "already granted" in str(exc)


async def _auth(store: Store, what: str, method: str, req: Any) -> Any:
    return await store.call(what, lambda m, t: getattr(m.auth, method)(req, timeout=t))


async def apply(store: Store, rbac: RbacPlan, *, enable: bool = True) -> None:
    """Create ``rbac``'s roles and users in the etcd behind ``store`` and (``enable``) turn auth on.
    Raises ``StorePermissionDenied`` when ``store``'s identity may not manage users (not a root admin)."""
    for role, grants in rbac.roles.items():
        try:
            await _auth(store, f"role add {role}", "RoleAdd", rpc.AuthRoleAddRequest(name=role))
        except StoreError as exc:
            if not _exists(exc):
                raise
        for g in grants:
            await _auth(store, f"role {role} grant {g.access} {g.key}", "RoleGrantPermission",
                        rpc.AuthRoleGrantPermissionRequest(name=role, perm=g.permission()))
    for user, user_roles in rbac.users.items():
        try:
            await _auth(store, f"user add {user}", "UserAdd",
                        rpc.AuthUserAddRequest(name=user, options=rpc.UserAddOptions(no_password=True)))
        except StoreError as exc:
            if not _exists(exc):
                raise
        for role in user_roles:
            await _auth(store, f"user {user} grant {role}", "UserGrantRole",
                        rpc.AuthUserGrantRoleRequest(user=user, role=role))
    if enable:
        await _auth(store, "auth enable", "AuthEnable", rpc.AuthEnableRequest())


@dataclass(frozen=True, slots=True)
class CutOff:
    """What :func:`cut_off` did: the etcd user (None: etcd has no such user), the roles it took away, and the
    lease of the site's ``live/`` key it revoked (None: no key, or not a site)."""

    identity: Identity
    user: str | None
    roles: tuple[str, ...] = ()
    lease: int | None = None

    def lines(self) -> list[str]:
        """What was done, for people."""
        out = []
        if self.user is None:
            out.append(f"etcd has no user {self.identity.common_name}: no roles to take away")
        elif self.roles:
            out.append(f"etcd user {self.user}: took away {', '.join(self.roles)} (every request on a connection "
                       f"it holds is refused from now on)")
        else:
            out.append(f"etcd user {self.user} holds no role (already cut off)")
        if self.identity.kind == "site":
            out.append(f"revoked lease {self.lease:x} of {live_key(self.identity.name)}: its heartbeat is gone"
                       if self.lease is not None else f"no {live_key(self.identity.name)} heartbeat to revoke")
        return out


def _not_found(exc: StoreError) -> bool:
    return "not found" in str(exc) or "not granted" in str(exc)


#: how many times each step of :func:`cut_off` is sent while etcd's connection is being reset
CUT_TRIES = 5

_T = TypeVar("_T")


async def _through_resets(step: Callable[[bool], Awaitable[_T]]) -> _T:
    """``step(retried)``, sent again while the connection to etcd is lost (``StoreUnavailable``), at most
    :data:`CUT_TRIES` times. A revocation ends the connections already open to etcd (the bound of
    :mod:`tiermesh.crl_follow` beside etcd resets them all), the operator's own among them, often in the middle of
    the cut: each step is idempotent, so sending it again is safe; ``retried`` tells a step that an earlier try may
    have done its work before the reply was lost."""
    pause = Backoff(0.1, 1.0)
    for attempt in range(1, CUT_TRIES + 1):
        try:
            return await step(attempt > 1)
        except StoreUnavailable:
            if attempt == CUT_TRIES:
                raise
            await asyncio.sleep(pause.next())
    raise AssertionError("unreachable")  # pragma: no cover


async def cut_off(store: Store, identity: Identity) -> CutOff:
    """Cut ``identity`` off etcd now: take every role from its etcd user (``identity.common_name``), so etcd
    refuses each request on a connection it already holds, and for a site revoke the lease of its
    ``live/<site>`` key, so its heartbeat disappears and it cannot write it again. Idempotent; a missing user,
    role or key is not an error. ``store`` must hold a root admin's certificate (``StorePermissionDenied``
    otherwise). Giving the roles back is :func:`apply`'s (``tiermesh etcd-rbac``), for an identity issued again.

    The roles go first (root last, so a root admin revoking itself still gets through the rest): a site whose
    lease vanished while it could still write would re-create its heartbeat under a fresh lease. Each step is
    sent again through a reset connection (:func:`_through_resets`); one whose reply was lost and that then
    finds its work done is reported as done."""
    user = identity.common_name

    async def held_roles(_: bool) -> list[str] | None:
        try:
            held = await _auth(store, f"user get {user}", "UserGet", rpc.AuthUserGetRequest(name=user))
        except (StorePermissionDenied, StoreUnavailable):
            raise
        except StoreError as exc:
            if not _not_found(exc):
                raise
            return None
        return list(held.roles)

    def revoking(role: str) -> Callable[[bool], Awaitable[bool]]:
        async def step(retried: bool) -> bool:
            return await _revoke_role(store, user, role) or retried
        return step

    roles = await _through_resets(held_roles)
    taken: list[str] = []
    lease = None
    for role in (r for r in roles or () if r != ROOT_ROLE):
        if await _through_resets(revoking(role)):
            taken.append(role)
    if identity.kind == "site":
        live = await _through_resets(lambda _: store.get(live_key(identity.name)))
        if live is not None and live.lease:
            held_lease = live.lease

            async def end_lease(retried: bool) -> bool:
                return await store.revoke_lease(held_lease) or retried

            if await _through_resets(end_lease):
                lease = held_lease
    if roles is not None and ROOT_ROLE in roles and await _through_resets(revoking(ROOT_ROLE)):
        taken.append(ROOT_ROLE)
    return CutOff(identity, None if roles is None else user, tuple(taken), lease)


async def _revoke_role(store: Store, user: str, role: str) -> bool:
    try:
        await _auth(store, f"user {user} revoke {role}", "UserRevokeRole",
                    rpc.AuthUserRevokeRoleRequest(name=user, role=role))
    except StorePermissionDenied:
        raise
    except StoreError as exc:
        if _not_found(exc):
            return False  # revoked meanwhile by someone else: the same end
        raise
    return True
