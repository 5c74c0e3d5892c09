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
    "AGENT_GRPC_PORT",
    "AGENT_HTTP_PORT",
    "AGENT_ZMQ_PORT",
    "CONSOLE_PORT",
    "CONSOLE_SCRAPER",
    "ETCD_IDENTITY",
    "OPERATOR_IDENTITY",
    "SCHEDULER_IDENTITY",
    "STORE_IDENTITY",
    "STORE_PORT",
    "HostCommand",
    "agent_command",
    "crl_follower_command",
    "etcd_rbac_command",
    "identity_env",
    "scheduler_command",
    "shared_env",
    "store_command",
    "topology_apply_command",
]

AGENT_HTTP_PORT = 8000  # Open Inference Protocol (KServe V2) over mutual TLS; /metrics for admins on the same port
AGENT_GRPC_PORT = 8001  # the Open Inference Protocol over gRPC (mutual TLS), Triton's gRPC port
AGENT_ZMQ_PORT = 5555   # site-to-site ZeroMQ (CURVE)
STORE_PORT = 8080       # the variant store's blobs and catalog over mutual TLS; /metrics for admins and schedulers
STORE_IDENTITY = Identity("store", "variant-store")
SCHEDULER_IDENTITY = Identity("scheduler", "scheduler")
CONSOLE_PORT = 8443     # a scheduler's admin console over mutual TLS (admins only): the scheduler's /metrics is there
CONSOLE_SCRAPER = Identity("admin", "console")  # the console reads the agents' /metrics as this admin
OPERATOR_IDENTITY = Identity("admin", "operator")  # etcd root: applies RBAC and the topology
# etcd's own certificate, an identity kind of its own (never a site's: no tiermesh server admits it, and it is
# issued and revoked like every other): its client and peer ports, and the etcd client identity of the CRL follower
# beside it, which RBAC lets read pki/crl and nothing else (`tiermesh etcd-rbac --crl-follower etcd:etcd`)
ETCD_IDENTITY = Identity("etcd", "etcd")


@dataclass(frozen=True, slots=True)
class HostCommand:
    """``tiermesh <args>`` with ``env`` set (on top of :func:`shared_env`), as ``identity`` on its own host."""

    identity: Identity
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    # other identities whose own files this host holds too (a scheduler's console scrapes agents as an admin)
    also: tuple[Identity, ...] = ()

    def pki_files(self, home: str) -> dict[PurePosixPath, tuple[Identity, str]]:
        """Every file this host holds under ``home/pki`` -> (the identity, its role in
        :meth:`~mesh.pki.files.PkiPaths.host_files`): the union of its identities' host files, nothing else. The CA
        and the revocation list are everyone's; they are listed once, under the host's own identity."""
        files: dict[PurePosixPath, tuple[Identity, str]] = {}
        for who in (self.identity, *self.also):
            for role, path in _pki(home).host_files(who).items():
                files.setdefault(PurePosixPath(path), (who, role))
        return files


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
                  http_port: int = AGENT_HTTP_PORT, zmq_port: int = AGENT_ZMQ_PORT,
                  grpc_port: int = AGENT_GRPC_PORT) -> HostCommand:
    """The agent of ``site``: HTTPS and gRPC with client certificates at its edge API, CURVE to its peers, its identity
    under ``home/pki`` (the agent's default PKI directory). ``advertise`` is what peers dial (a pod IP, a
    namespace's address)."""
    me = Identity("site", site)
    args = ("agent", "--site", site, "--bind", bind, "--advertise", advertise,
            "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--zmq-port", str(zmq_port))
    return HostCommand(me, args, identity_env(me, home))


def store_command(*, home: str, advertise: str, site: str | None, bind: str = "0.0.0.0", port: int = STORE_PORT,
                  identity: Identity = STORE_IDENTITY, tls: bool = True) -> HostCommand:
    """The variant store: HTTPS as its own ``store`` identity (never a site's), blobs under ``home/blobs``,
    announced in etcd at ``advertise``; ``site`` is where it runs in the topology (fetches are priced from
    there). ``tls`` False: plain HTTP, for an ``--insecure`` lab only (never rendered into a manifest)."""
    args: tuple[str, ...] = ("variants", "serve", "--bind", bind, "--advertise", advertise, "--port", str(port))
    args += ("--pki-dir", str(_pki(home).root), "--name", identity.name) if tls else ()
    args += ("--site", site) if site else ()
    return HostCommand(identity, args, identity_env(identity, home))


def scheduler_command(candidate_id: str, *, home: str, identity: Identity = SCHEDULER_IDENTITY,
                      console_port: int | None = None, bind: str = "0.0.0.0", advertise: str | None = None,
                      scraper: Identity = CONSOLE_SCRAPER) -> HostCommand:
    """A scheduler replica (placement, leader election), candidate ``candidate_id`` (a pod name). With
    ``console_port`` it also serves the admin console there (HTTPS as ``identity`` itself, so the host needs no
    second server certificate; the scheduler's ``/metrics`` is served only there) at ``bind``, printed as
    ``advertise``, and scrapes the agents as ``scraper``, an admin identity whose files it then holds too."""
    args: tuple[str, ...] = ("scheduler", "--id", candidate_id)
    if console_port is None:
        return HostCommand(identity, args, identity_env(identity, home))
    args += ("--bind", bind, *(("--advertise", advertise) if advertise else ()), "--console-port", str(console_port),
             "--console-name", identity.name, "--console-admin", scraper.name)
    return HostCommand(identity, args, identity_env(identity, home), also=(scraper,))


def etcd_rbac_command(topology: str, *, etcd: str, prefix: str, home: str,
                      root_admin: Identity = OPERATOR_IDENTITY, scheduler: Identity = SCHEDULER_IDENTITY,
                      store: Identity = STORE_IDENTITY, crl_follower: Identity = ETCD_IDENTITY) -> HostCommand:
    """etcd's users and roles for the mesh of ``topology`` (a file on the host), then auth on; idempotent, so a Job
    may run it on every apply. As ``root_admin`` (etcd root). etcd's URLs and the prefix are flags:
    ``etcd-rbac`` reads neither from ``TIERMESH_ETCD`` / ``TIERMESH_PREFIX``."""
    args = ("etcd-rbac", "--topology", topology, "--etcd", etcd, "--prefix", prefix,
            "--root-admin", root_admin.name, "--scheduler", scheduler.name, "--store", store.name,
            "--crl-follower", crl_follower.common_name)
    return HostCommand(root_admin, args, identity_env(root_admin, home))


def topology_apply_command(topology: str, *, home: str, identity: Identity = OPERATOR_IDENTITY) -> HostCommand:
    """Apply the topology file ``topology`` (one transaction, idempotent), as an operator."""
    return HostCommand(identity, ("topology", "apply", topology), identity_env(identity, home))


def crl_follower_command(out: str, *, home: str, identity: Identity = ETCD_IDENTITY,
                         signal_process: str | None = None, stagger_s: float | None = None,
                         drop_connections: int | None = None) -> HostCommand:
    """Beside etcd: keep ``out`` (etcd's ``--client-crl-file``) current from etcd ``pki/crl``, verified against
    ``home/pki/ca.pem``, and after a list that revokes someone new end the connections they hold: SIGTERM
    ``signal_process`` (shared PID namespace, after ``stagger_s`` x the hostname's ordinal) or reset every
    connection to port ``drop_connections`` (CAP_NET_ADMIN). As etcd's own certificate (``identity``)."""
    args: tuple[str, ...] = ("pki", "follow-crl", "--out", out)
    if signal_process is not None:
        args += ("--signal-process", signal_process)
        args += ("--stagger-s", f"{stagger_s:g}") if stagger_s is not None else ()
    elif drop_connections is not None:
        args += ("--drop-connections", str(drop_connections))
    return HostCommand(identity, args, identity_env(identity, home))
