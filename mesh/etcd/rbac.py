"""etcd RBAC for a mesh: who may read and write which keys, as pure data (:func:`plan`), and applying it
to an etcd cluster (:func:`apply`).

With ``--client-cert-auth`` etcd takes the client certificate's subject CN as the user name, and the mesh
CA writes ``<kind>:<name>`` there (:attr:`mesh.pki.identity.Identity.common_name`), so the users here are
named after identities and have no password. Roles (all relative to the store prefix ``P``):

- ``site:<S>`` (an agent): read everything under ``P``; write only ``P live/<S>`` (its heartbeat) and
  ``P pki/sites/<S>`` (its own certificate, public: peers believe it only if the CA signed it).
- ``scheduler:<N>``: read everything under ``P``; write ``placement/``, ``events/`` and ``election/``.
- ``store:<N>`` (the variant store): read everything under ``P``; write ``catalog/``, ``models/`` (what it
  builds) and ``services/`` (its announcement).
- ``admin:<N>`` (operators): read everything under ``P``; write ``topology/``, ``tenants/``, ``catalog/``,
  ``models/``, ``pki/`` and ``services/``.
- ``root_admins`` (the admin identities that apply this plan; at least one): etcd's ``root`` role, which
  user and role management, ``auth enable`` and compaction need.
- tenants: no etcd user at all, so etcd refuses everything they ask (permission denied).

:func:`apply` is idempotent (existing users and roles are kept; permissions are granted again) and ends
with ``auth enable``. Run it as a root admin's certificate: before auth is enabled anyone may manage
users; after, only a user with the ``root`` role may.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mesh.errors import ConfigError, StoreError
from mesh.etcd import messages as rpc
from mesh.etcd.keys import (
    CATALOG,
    ELECTION_SCHEDULER,
    EVENTS_PLACEMENT,
    MODELS,
    PKI,
    PLACEMENT,
    SERVICES,
    TENANTS,
    live_key,
    site_cert_key,
)
from mesh.etcd.store import Store
from mesh.etcd.wire import prefix_end
from mesh.pki.identity import Identity

__all__ = ["ROOT_ROLE", "ROOT_USER", "Grant", "RbacPlan", "apply", "plan"]

ROOT_ROLE = "root"
ROOT_USER = "root"  # etcd refuses `auth enable` unless a user named root with the root role exists
Access = Literal["read", "write", "readwrite"]
_PERM = {"read": rpc.Permission.READ, "write": rpc.Permission.WRITE, "readwrite": rpc.Permission.READWRITE}
OPERATOR_WRITES = ("topology/", TENANTS, CATALOG, MODELS, PKI, SERVICES)
STORE_WRITES = (CATALOG, MODELS, SERVICES)
SCHEDULER_WRITES = (PLACEMENT, EVENTS_PLACEMENT.split("/")[0] + "/", ELECTION_SCHEDULER.split("/")[0] + "/")


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


def _names(kind: str, names: Iterable[str]) -> list[Identity]:
    return sorted({Identity(kind, n) for n in names})  # type: ignore[arg-type]  # Identity checks the kind


def plan(prefix: str, *, sites: Iterable[str], schedulers: Iterable[str] = (), admins: Iterable[str] = (),
         root_admins: Iterable[str], stores: Iterable[str] = ()) -> RbacPlan:
    """The RBAC plan for a mesh under ``prefix``. Names are identity names (``edge-1``), not CNs."""
    if not prefix.startswith("/") or not prefix.endswith("/") or prefix == "/":
        raise ConfigError(f"an RBAC prefix must start and end with '/' and not be '/': {prefix!r}")
    roots = _names("admin", root_admins)
    if not roots:
        raise ConfigError("RBAC needs at least one root admin (the identity that applies it and manages etcd)")
    roles: dict[str, tuple[Grant, ...]] = {ROOT_ROLE: ()}  # etcd's built-in superuser role, created empty
    users: dict[str, tuple[str, ...]] = {ROOT_USER: (ROOT_ROLE,)}
    read_all = Grant(prefix, "read", True)
    for site in _names("site", sites):
        role = f"tiermesh-{site.common_name}"
        roles[role] = (read_all, Grant(prefix + live_key(site.name), "write", False),
                       Grant(prefix + site_cert_key(site.name), "write", False))
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
    return RbacPlan(prefix, roles, users)


def _exists(exc: StoreError) -> bool:
    return "already exists" in str(exc) or "already granted" in str(exc)


async def _auth(store: Store, what: str, method: str, req: Any) -> None:
    await store.call(what, lambda m, t: getattr(m.auth, method)(req, timeout=t))


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
