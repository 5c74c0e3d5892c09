"""Kubernetes manifests generated from a topology file and :mod:`tiermesh.hosts`, so the per-site parts never drift
from the topology, and no pod's command line or files drift from what the lab runs.

``python -m tiermesh.deploy render examples/topology.yaml --out deploy/k8s`` writes

- ``30-config.yaml``: the ConfigMap every tiermesh container takes its shared settings from
  (:func:`tiermesh.hosts.shared_env`: etcd's members, the key prefix, the home, the log format);
- ``40-topology.yaml``: the ConfigMap holding the topology file verbatim (the RBAC and apply Jobs mount it);
- ``placeholder-secrets/sites.yaml``: a placeholder certificate Secret per site (``tiermesh pki`` issues the real
  ones; the folder is outside ``kubectl apply -f deploy/k8s/`` so real ones are never overwritten);
- ``80-agents.yaml``: per site, one agent Deployment pinned to that site's nodes (``nodeSelector`` on
  ``topology.kubernetes.io/region`` and ``tiermesh.io/site``), its resources mirroring the site's declared
  hardware, and for an edge site a Service for the Open Inference Protocol API.

An agent's arguments and its own environment are :func:`tiermesh.hosts.agent_command`'s, with the pod IP as the
address peers dial. It is secured (HTTPS with client certificates at the edge; ``--insecure`` is never rendered)
and reads its PKI where ``tiermesh pki`` writes it, ``$TIERMESH_HOME/pki`` (:class:`mesh.pki.files.PkiPaths`).
Every tiermesh pod holds there exactly the host files of its identities (:meth:`tiermesh.hosts.HostCommand.
pki_files`), projected from two Secrets (:func:`pki_files`): the mesh-wide ``tiermesh-trust`` (the CA and the
revocation list, one object to update on ``tiermesh pki revoke``) and the identity's own
(:func:`identity_secret`: certificate, key, a site's CURVE keys). Kubernetes updates projected files in place, and
the processes re-read them: rotation needs no restart. An agent's probes cannot be ``httpGet`` (the kubelet has no
client certificate): liveness and startup are ``tcpSocket``; readiness runs ``tiermesh agent --probe``, a GET of
``/v2/health/ready`` with the site's own certificate.

``--check`` compares instead of writing (exit 1 and the name of each stale file); without ``--out`` the
documents go to stdout. The hand-written manifests beside them (etcd, the RBAC and topology Jobs, the variant
store, the schedulers, the metrics Services) use the same names, ports and :mod:`tiermesh.hosts` command lines;
``tests/unit/test_deploy_manifests.py`` holds both sides to them.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from ruamel.yaml import YAML
from ruamel.yaml.scalarstring import LiteralScalarString

from mesh.errors import ConfigError, MeshError
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from tiermesh.hosts import AGENT_GRPC_PORT, AGENT_HTTP_PORT, AGENT_ZMQ_PORT, HostCommand, agent_command, shared_env
from topology.loader import parse_topology
from topology.schema import Site, Topology

__all__ = [
    "AGENTS_FILE", "AGENT_PKI", "CONFIG_FILE", "CONFIG_MAP", "ETCD_MEMBERS", "ETCD_URLS", "GPU_IMAGE", "HOME",
    "IMAGE", "NAMESPACE", "PREFIX", "SECRET_KEYS", "SITE_SECRETS_FILE", "TOPOLOGY_CONFIG_FILE", "TOPOLOGY_CONFIG_MAP",
    "TOPOLOGY_FILE", "TRUST_SECRET", "UID", "agent_documents", "agent_pki_files", "config_documents",
    "container_security", "identity_secret", "main", "pki_files", "pki_volume", "pod_security", "render",
    "site_secret_documents", "topology_documents",
]

NAMESPACE: Final = "tiermesh"
IMAGE: Final = "tiermesh:0.1.0"  # built from deploy/Containerfile; push it to your registry and edit
GPU_IMAGE: Final = "tiermesh:0.1.0-gpu"  # the same recipe with --build-arg EXTRAS=all,gpu
HOME: Final = "/var/lib/tiermesh"  # TIERMESH_HOME: the only writable place besides /tmp
PREFIX: Final = "/tiermesh/"  # the etcd key prefix of this mesh
# $TIERMESH_HOME/pki of every tiermesh pod, where `tiermesh pki` writes and every process reads its files
AGENT_PKI: Final = PkiPaths.under(HOME)
TRUST_SECRET: Final = "tiermesh-trust"  # ca.crt (the mesh CA) and crl.pem (its revocation list), for every pod
# the key in a Secret of each role of PkiPaths.host_files; ca and crl are in TRUST_SECRET, the rest the identity's
SECRET_KEYS: Final = {"ca": "ca.crt", "crl": "crl.pem", "cert": "tls.crt", "key": "tls.key", "curve": "curve"}
_TRUST_ROLES: Final = ("ca", "crl")
CONFIG_MAP: Final = "tiermesh-config"  # TIERMESH_* settings shared by every tiermesh container
TOPOLOGY_CONFIG_MAP: Final = "tiermesh-topology"
TOPOLOGY_FILE: Final = "topology.yaml"
CONFIG_FILE: Final = "30-config.yaml"
TOPOLOGY_CONFIG_FILE: Final = "40-topology.yaml"
AGENTS_FILE: Final = "80-agents.yaml"
SITE_SECRETS_FILE: Final = "placeholder-secrets/sites.yaml"
ETCD_MEMBERS: Final = 3
# The stable DNS names of the etcd StatefulSet's pods behind its headless Service ``etcd``.
ETCD_URLS: Final = ",".join(f"https://etcd-{i}.etcd.{NAMESPACE}.svc:2379" for i in range(ETCD_MEMBERS))
UID: Final = 10001  # the non-root user the image creates

_HEADER = ("# GENERATED by `python -m tiermesh.deploy render {src} --out deploy/k8s` from {src}.\n"
           "# Do not edit: edit the topology and re-render (a unit test fails while this file is stale).\n")


def identity_secret(identity: Identity) -> str:
    """The Secret holding an identity's own files (``tls.crt``, ``tls.key``, a site's ``curve``)."""
    return f"tiermesh-{identity.kind}-{identity.name}"


# what a placeholder says each key of an identity's Secret holds
_PLACEHOLDER: Final = {"cert": "certificate of {who} (PEM): pki/{path}",
                       "key": "private key of {who} (PEM): pki/{path}",
                       "curve": "CURVE key pair of {who} (ZeroMQ between sites): pki/{path}"}


def pki_files(host: HostCommand) -> dict[Path, tuple[str, str]]:
    """Every file ``host``'s pod holds under ``$TIERMESH_HOME/pki`` (exactly its host files) -> the (Secret, key) it
    is projected from. ``crl.pem`` is required: agents and the store refuse to serve HTTPS without a list."""
    return {Path(path): (TRUST_SECRET if role in _TRUST_ROLES else identity_secret(who), SECRET_KEYS[role])
            for path, (who, role) in host.pki_files(HOME).items()}


def agent_pki_files(site: str) -> dict[Path, tuple[str, str]]:
    """:func:`pki_files` of the agent of ``site``."""
    return pki_files(_agent(site))


def pki_volume(host: HostCommand, name: str = "pki") -> dict[str, Any]:
    """The projected volume, mounted at ``$TIERMESH_HOME/pki``, holding :func:`pki_files` of ``host``."""
    sources: dict[str, list[dict[str, str]]] = {}
    for path, (secret, key) in pki_files(host).items():
        sources.setdefault(secret, []).append({"key": key, "path": str(path.relative_to(AGENT_PKI.root))})
    # 0440 and the pod's fsGroup: readable by the process, the keys by nobody else
    return {"name": name, "projected": {"defaultMode": 0o440, "sources": [
        {"secret": {"name": secret, "items": items}} for secret, items in sources.items()]}}


def _agent(site: str, advertise: str = "$(POD_IP)") -> HostCommand:
    return agent_command(site, home=HOME, advertise=advertise)


def _labels(component: str, **extra: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": f"tiermesh-{component}", "app.kubernetes.io/part-of": "tiermesh",
            "app.kubernetes.io/component": component, **extra}


def _cpu(cores: float) -> str:
    millis = round(cores * 1000)
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def _resources(site: Site) -> dict[str, Any]:
    """Limits are the site's declared box; requests half of it, so the pod fits a node of that size
    beside the kubelet's reservations. GPUs are whole devices: request = limit."""
    hw = site.hardware
    limits: dict[str, Any] = {"cpu": _cpu(hw.cpu_cores), "memory": f"{hw.memory_mb}Mi"}
    requests: dict[str, Any] = {"cpu": _cpu(max(0.5, hw.cpu_cores / 2)), "memory": f"{hw.memory_mb // 2}Mi"}
    if hw.gpus:
        limits["nvidia.com/gpu"] = len(hw.gpus)
        requests["nvidia.com/gpu"] = len(hw.gpus)
    return {"requests": requests, "limits": limits}


def pod_security() -> dict[str, Any]:
    """Pod-level securityContext of every tiermesh pod (the namespace enforces Pod Security 'restricted')."""
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def _agent_deployment(site: Site) -> dict[str, Any]:
    name = f"agent-{site.name}"
    selector = {"app.kubernetes.io/name": "tiermesh-agent", "tiermesh.io/site": site.name}
    labels = _labels("agent", **{"tiermesh.io/site": site.name, "tiermesh.io/tier": site.tier})
    gpus = bool(site.hardware.gpus)
    host = _agent(site.name)
    container: dict[str, Any] = {
        "name": "agent",
        "image": GPU_IMAGE if gpus else IMAGE,
        "imagePullPolicy": "IfNotPresent",
        # tiermesh.hosts.agent_command, as the lab runs it. $(POD_IP) is expanded by the kubelet from the env
        # below: peers dial the pod, not a Service, because every site is its own ZeroMQ peer. It binds all IPv4
        # addresses (use "::" on IPv6 clusters).
        "args": list(host.args),
        # The agent is its site to etcd too (its own files under $TIERMESH_HOME/pki).
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                *({"name": k, "value": v} for k, v in host.env.items())],
        "envFrom": [{"configMapRef": {"name": CONFIG_MAP}}],
        # 8000 serves the Open Inference Protocol and, for admin and scheduler certificates, /metrics: both HTTPS
        "ports": [{"name": "https", "containerPort": AGENT_HTTP_PORT, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": AGENT_GRPC_PORT, "protocol": "TCP"},
                  {"name": "zmq", "containerPort": AGENT_ZMQ_PORT, "protocol": "TCP"}],
        # Ready once the agent holds a routing snapshot and the catalog's task signatures. The edge API
        # wants a client certificate, which an httpGet probe cannot present: the agent's own command asks it
        # with the site's certificate (a Python start, ~0.5 s of CPU: hence every 10 s and a long timeout).
        "readinessProbe": {"exec": {"command": ["tiermesh", "agent", "--site", site.name,
                                                "--http-port", str(AGENT_HTTP_PORT), "--probe"]},
                           "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 3},
        # Alive while the HTTPS listener accepts connections (a TCP connect, no handshake).
        "livenessProbe": {"tcpSocket": {"port": "https"},
                          "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 3},
        "startupProbe": {"tcpSocket": {"port": "https"}, "periodSeconds": 2, "failureThreshold": 60},
        "resources": _resources(site),
        "securityContext": container_security(),
        "volumeMounts": [{"name": "home", "mountPath": HOME}, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "pki", "mountPath": str(AGENT_PKI.root), "readOnly": True}],
    }
    pod: dict[str, Any] = {
        "nodeSelector": {"topology.kubernetes.io/region": site.region, "tiermesh.io/site": site.name},
        "securityContext": pod_security(),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
        "volumes": [
            # The blob cache: variants fetched from the variant store; bounded by the site's memory,
            # since every cached variant is one the site could load.
            {"name": "home", "emptyDir": {"sizeLimit": f"{site.hardware.memory_mb}Mi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
            pki_volume(host),
        ],
    }
    if gpus:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {
            # One agent per site: it holds live/<site> under a lease, and two would fight over it.
            # Recreate, so a rollout never runs the old and the new agent of a site side by side.
            "replicas": 1, "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def _oip_service(site: Site) -> dict[str, Any]:
    """The edge's Open Inference Protocol endpoint for callers. ClusterIP here: expose it the way the
    cluster reaches its callers (type LoadBalancer, or an Ingress/Gateway route to this Service)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": f"agent-{site.name}", "namespace": NAMESPACE,
                     "labels": _labels("agent", **{"tiermesh.io/site": site.name})},
        "spec": {"type": "ClusterIP",
                 "selector": {"app.kubernetes.io/name": "tiermesh-agent", "tiermesh.io/site": site.name},
                 "ports": [{"name": "https", "port": AGENT_HTTP_PORT, "targetPort": "https", "protocol": "TCP",
                            "appProtocol": "https"},  # mutual TLS: no TLS-terminating proxy in between
                           {"name": "grpc", "port": AGENT_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                            "appProtocol": "grpc"}]},
    }


def _check_names(topo: Topology) -> None:
    # The topology already holds names to DNS labels (lowercase, digits, '-', <= 63); a Service name
    # is one too, and "agent-" takes six of its 63 characters.
    for site in topo.sites:
        if len(f"agent-{site}") > 63:
            raise ConfigError(f"site {site!r}: Kubernetes names the agent 'agent-{site}', longer than 63 "
                              f"characters; use a site name of at most 57")


def agent_documents(topo: Topology) -> list[dict[str, Any]]:
    """Per site (in the file's order): its agent Deployment, then for an edge its OIP Service."""
    _check_names(topo)
    docs: list[dict[str, Any]] = []
    for site in topo.sites.values():
        docs.append(_agent_deployment(site))
        if site.tier == "edge":
            docs.append(_oip_service(site))
    return docs


def topology_documents(text: str) -> list[dict[str, Any]]:
    """The ConfigMap the topology-apply Job mounts at /etc/tiermesh/topology.yaml (the file verbatim)."""
    return [{"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": TOPOLOGY_CONFIG_MAP, "namespace": NAMESPACE, "labels": _labels("topology")},
             "data": {TOPOLOGY_FILE: LiteralScalarString(text)}}]


def site_secret_documents(topo: Topology) -> list[dict[str, Any]]:
    """A placeholder Secret per site, under the name its agent's pod projects: the site's own files (the CA and
    the revocation list are in ``tiermesh-trust``)."""
    _check_names(topo)
    docs: list[dict[str, Any]] = []
    for site in topo.sites.values():
        me = Identity("site", site.name)
        own = {role: path for role, path in AGENT_PKI.host_files(me).items() if role not in _TRUST_ROLES}
        docs.append({"apiVersion": "v1", "kind": "Secret",
                     "metadata": {"name": identity_secret(me), "namespace": NAMESPACE,
                                  "labels": _labels("agent", **{"tiermesh.io/site": site.name})},
                     "type": "Opaque",
                     "stringData": {SECRET_KEYS[role]: "PLACEHOLDER: " + _PLACEHOLDER[role].format(
                         who=me.uri, path=path.relative_to(AGENT_PKI.root)) for role, path in own.items()}})
    return docs


def config_documents() -> list[dict[str, Any]]:
    """The settings every tiermesh container shares (``envFrom``): :func:`tiermesh.hosts.shared_env`. Each pod
    adds its own identity's etcd client files (``env`` beats ``envFrom``)."""
    return [{"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": CONFIG_MAP, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/part-of":
                                                                                  "tiermesh"}},
             "data": shared_env(etcd=ETCD_URLS, prefix=PREFIX, home=HOME)}]


def _dump(docs: list[dict[str, Any]], src: str) -> str:
    yaml = YAML()
    yaml.width = 4096  # one flag per line stays one line
    out = io.StringIO()
    out.write(_HEADER.format(src=src))
    yaml.dump_all(docs, out)
    return out.getvalue()


def render(topology_path: Path, src: str | None = None) -> dict[str, str]:
    """File name -> YAML text of every generated manifest. ``src`` is the path the header names
    (default: ``topology_path`` as given), so the output does not depend on the working directory."""
    text = topology_path.read_text(encoding="utf-8")
    topo = parse_topology(text, file=str(topology_path))  # a bad topology fails here with its line
    name = src or str(topology_path)
    return {CONFIG_FILE: _dump(config_documents(), name),
            TOPOLOGY_CONFIG_FILE: _dump(topology_documents(text), name),
            SITE_SECRETS_FILE: _dump(site_secret_documents(topo), name),
            AGENTS_FILE: _dump(agent_documents(topo), name)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiermesh.deploy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="render the per-site manifests from a topology file")
    r.add_argument("topology", type=Path)
    r.add_argument("--out", type=Path, default=None, help="directory to write into (default: stdout)")
    r.add_argument("--check", action="store_true", help="with --out: compare, exit 1 if any file is stale")
    args = p.parse_args(argv)
    try:
        files = render(args.topology)
    except (MeshError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write("---\n".join(files.values()))
        return 0
    stale = [n for n, t in files.items() if not (args.out / n).exists() or (args.out / n).read_text() != t]
    if args.check:
        for n in stale:
            print(f"stale: {args.out / n} (re-render: python -m tiermesh.deploy render {args.topology} "
                  f"--out {args.out})", file=sys.stderr)
        return 1 if stale else 0
    for n in stale:
        (args.out / n).parent.mkdir(parents=True, exist_ok=True)
        (args.out / n).write_text(files[n], encoding="utf-8")
        print(f"wrote {args.out / n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
