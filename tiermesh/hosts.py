"""What each host of a deployed mesh runs, written once: the command line and the settings of a site's agent, the
variant store and a scheduler replica, and the PKI files each one holds.

Two readers, one source: the Kubernetes renderer (:mod:`tiermesh.deploy`) puts these arguments and environment into
its manifests, and the lab (``tiermesh up --netns``, :mod:`tiermesh.harness`) starts every process with them, each in
a network namespace with a home of its own holding exactly :meth:`mesh.pki.files.PkiPaths.host_files` of its
identity. What the lab adds beyond them (a ready file, the WAN emulation's peer map, a CPU cap) is lab plumbing and
is appended after, never instead.

Settings travel as ``TIERMESH_*`` variables (:class:`mesh.settings.MeshSettings`): :func:`shared_env` is what every
process of a mesh shares (Kubernetes: the ``tiermesh-config`` ConfigMap), :attr:`HostCommand.env` what one host
sets for itself (its etcd client certificate: its own identity's files under its home).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity

__all__ = [
    "AGENT_HTTP_PORT",
    "AGENT_ZMQ_PORT",
    "SCHEDULER_IDENTITY",
    "STORE_IDENTITY",
    "STORE_PORT",
    "HostCommand",
    "agent_command",
    "identity_env",
    "scheduler_command",
    "shared_env",
    "store_command",
]

AGENT_HTTP_PORT = 8000  # Open Inference Protocol (KServe V2) over mutual TLS; /metrics for admins on the same port
AGENT_ZMQ_PORT = 5555   # site-to-site ZeroMQ (CURVE)
STORE_PORT = 8080       # the variant store's blobs and catalog over mutual TLS; /metrics for admins and schedulers
STORE_IDENTITY = Identity("store", "variant-store")
SCHEDULER_IDENTITY = Identity("scheduler", "scheduler")


@dataclass(frozen=True, slots=True)
class HostCommand:
    """``tiermesh <args>`` with ``env`` set (on top of :func:`shared_env`), as ``identity`` on its own host."""

    identity: Identity
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


def _pki(home: str | PurePosixPath) -> PkiPaths:
    # PurePosixPath: a manifest names paths inside the container, whatever machine renders it
    return PkiPaths(PurePosixPath(home) / "pki")  # type: ignore[arg-type]  # PkiPaths only joins its root


def shared_env(*, etcd: str, prefix: str, home: str, log_format: str = "json") -> dict[str, str]:
    """The settings every tiermesh process of one mesh shares: etcd's members (comma-separated URLs), the key prefix,
    the home directory (the same path on every host; each host's own files under it) and the log format."""
    return {"TIERMESH_ETCD": etcd, "TIERMESH_PREFIX": prefix, "TIERMESH_HOME": home, "TIERMESH_LOG_FORMAT": log_format}


def identity_env(identity: Identity, home: str) -> dict[str, str]:
    """``identity``'s etcd client credentials: its own files under ``home/pki`` (etcd takes the certificate's CN
    as the user, so RBAC holds the process to its role)."""
    files = _pki(home).host_files(identity)
    return {"TIERMESH_ETCD_CA": str(files["ca"]), "TIERMESH_ETCD_CERT": str(files["cert"]),
            "TIERMESH_ETCD_KEY": str(files["key"])}


def agent_command(site: str, *, home: str, advertise: str, bind: str = "0.0.0.0",
                  http_port: int = AGENT_HTTP_PORT, zmq_port: int = AGENT_ZMQ_PORT) -> HostCommand:
    """The agent of ``site``: HTTPS with client certificates at its edge API, CURVE to its peers, its identity
    under ``home/pki`` (the agent's default PKI directory). ``advertise`` is what peers dial (a pod IP, a
    namespace's address)."""
    me = Identity("site", site)
    args = ("agent", "--site", site, "--bind", bind, "--advertise", advertise,
            "--http-port", str(http_port), "--zmq-port", str(zmq_port))
    return HostCommand(me, args, identity_env(me, home))


def store_command(*, home: str, advertise: str, site: str | None, bind: str = "0.0.0.0", port: int = STORE_PORT,
                  identity: Identity = STORE_IDENTITY) -> HostCommand:
    """The variant store: HTTPS as its own ``store`` identity (never a site's), blobs under ``home/blobs``,
    announced in etcd at ``advertise``; ``site`` is where it runs in the topology (fetches are priced from
    there)."""
    args: tuple[str, ...] = ("variants", "serve", "--bind", bind, "--advertise", advertise, "--port", str(port),
            "--pki-dir", str(_pki(home).root), "--name", identity.name)
    args += ("--site", site) if site else ()
    return HostCommand(identity, args, identity_env(identity, home))


def scheduler_command(candidate_id: str, *, home: str, identity: Identity = SCHEDULER_IDENTITY) -> HostCommand:
    """A scheduler replica (placement, leader election), candidate ``candidate_id`` (a pod name)."""
    return HostCommand(identity, ("scheduler", "--id", candidate_id), identity_env(identity, home))
