"""Every pod of deploy/k8s is a host of :mod:`tiermesh.hosts`: it runs exactly the command line and environment the
lab runs (one source for both), and holds exactly its identities' host files
(:meth:`mesh.pki.files.PkiPaths.host_files`): no other identity's certificate or key, no other Secret anywhere in
the pod. Also the revocation wiring a schema cannot see: etcd's ``--client-crl-file`` on a volume seeded from
``tiermesh-trust`` and kept current by the follower beside it, and the RBAC Job ordered before the mesh."""

from __future__ import annotations

import copy
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from mesh.pki.identity import Identity
from tests.helpers.topologies import EXAMPLE
from tests.unit.test_deploy_manifests import (
    DOCS,
    MANIFEST_FILES,
    _containers,
    _flag,
    _named,
    _pod_templates,
    _runs_tiermesh,
    _secret_files,
    _secret_sources,
)
from tiermesh import deploy, hosts
from topology.loader import load_topology_file

pytestmark = pytest.mark.unit

Doc = dict[str, Any]
HOME = deploy.HOME
TOPOLOGY_IN_POD = f"/etc/tiermesh/{deploy.TOPOLOGY_FILE}"
ETCD_CRL = "/etc/etcd/crl/crl.pem"
STORE_SITE = "core-eu"


def _hosts() -> dict[tuple[str, str], hosts.HostCommand]:
    """(workload, container) -> the host it must be, for every tiermesh process of deploy/k8s."""
    topo = load_topology_file(EXAMPLE)
    out = {(f"agent-{s}", "agent"): hosts.agent_command(s, home=HOME, advertise="$(POD_IP)") for s in topo.sites}
    out[("variant-store", "variant-store")] = hosts.store_command(
        home=HOME, advertise=f"variant-store.{deploy.NAMESPACE}.svc", site=STORE_SITE)
    out[("scheduler", "scheduler")] = hosts.scheduler_command("$(POD_NAME)", home=HOME, advertise="$(POD_IP)",
                                                              console_port=hosts.CONSOLE_PORT)
    out[("etcd-rbac", "etcd-rbac")] = hosts.etcd_rbac_command(TOPOLOGY_IN_POD, etcd=deploy.ETCD_URLS,
                                                              prefix=deploy.PREFIX, home=HOME)
    out[("topology-apply", "apply")] = hosts.topology_apply_command(TOPOLOGY_IN_POD, home=HOME)
    out[("etcd", "crl-follower")] = hosts.crl_follower_command(ETCD_CRL, home=HOME, signal_process="etcd",
                                                               stagger_s=30)
    return out


HOSTS = _hosts()
# the follower beside etcd holds what it reads: the CA (lists are verified against it) and etcd's own certificate and
# key (its etcd identity); not a site's CURVE key (etcd has none) nor the list (it gets that from etcd)
FOLLOWER_ROLES = ("ca", "cert", "key")


def _workloads() -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d, _ in _pod_templates()}


def _container(workload: str, name: str) -> tuple[Doc, Doc]:
    pod = _workloads()[workload]["spec"]["template"]["spec"]
    return pod, next(c for c in _containers(pod) if c["name"] == name)


def _wanted_files(key: tuple[str, str]) -> set[PurePosixPath]:
    host = HOSTS[key]
    if key == ("etcd", "crl-follower"):
        files = deploy.AGENT_PKI.host_files(host.identity)
        return {PurePosixPath(files[r]) for r in FOLLOWER_ROLES}
    return set(host.pki_files(HOME))


def test_every_tiermesh_process_is_a_host() -> None:
    """No pod runs tiermesh outside the table above, so none escapes the checks below."""
    running = {(d["metadata"]["name"], c["name"]) for d, t in _pod_templates() for c in _containers(t["spec"])
               if _runs_tiermesh(c)}
    assert running == set(HOSTS)


@pytest.mark.parametrize("key", list(HOSTS), ids=["/".join(k) for k in HOSTS])
def test_pods_run_the_hosts_command_line(key: tuple[str, str]) -> None:
    """args and the host's own environment are tiermesh.hosts' (the lab starts every process with them)."""
    _, c = _container(*key)
    host = HOSTS[key]
    assert c["args"] == list(host.args)
    own = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    assert own == dict(host.env)
    assert c["envFrom"] == [{"configMapRef": {"name": deploy.CONFIG_MAP}}]


def test_the_shared_settings_are_shared_env() -> None:
    cm = _named("ConfigMap", deploy.CONFIG_MAP)
    assert cm["data"] == hosts.shared_env(etcd=deploy.ETCD_URLS, prefix=deploy.PREFIX, home=HOME)


def _pod_secrets(pod: Doc) -> set[str]:
    return {src["name"] for v in pod.get("volumes", []) for src in _secret_sources(v)}


def _held(pod: Doc, c: Doc) -> dict[PurePosixPath, tuple[str, str]]:
    return {PurePosixPath(f): v for f, v in _secret_files(pod, c).items()}


def _check_holds_exactly(key: tuple[str, str], pod: Doc, c: Doc) -> None:
    held = _held(pod, c)
    wanted = _wanted_files(key)
    assert set(held) == wanted, f"{key}: extra {set(held) - wanted}, missing {wanted - set(held)}"
    if key[0] == "etcd":
        return  # etcd's pod also holds etcd's own TLS files, checked in test_etcd_reads_a_list_kept_current
    host = HOSTS[key]
    assert held == {PurePosixPath(p): v for p, v in deploy.pki_files(host).items()}
    # no other Secret anywhere in the pod: the trust Secret and its identities' own, nothing else
    assert _pod_secrets(pod) == {deploy.TRUST_SECRET} | {deploy.identity_secret(i) for i in (host.identity,
                                                                                            *host.also)}


@pytest.mark.parametrize("key", list(HOSTS), ids=["/".join(k) for k in HOSTS])
def test_pods_hold_exactly_their_host_files(key: tuple[str, str]) -> None:
    pod, c = _container(*key)
    _check_holds_exactly(key, pod, c)


def test_an_agent_holds_exactly_host_files_of_its_site() -> None:
    """Spelled out for the agents, straight from PkiPaths: the CA, the list, the site's own three files."""
    for (workload, _), host in HOSTS.items():
        if host.identity.kind != "site" or workload == "etcd":
            continue
        pod, c = _container(workload, "agent")
        wanted = set(deploy.AGENT_PKI.host_files(Identity("site", host.identity.name)).values())
        assert {Path(p) for p in _held(pod, c)} == wanted, workload


def test_the_mount_check_catches_a_peers_certificate() -> None:
    """The check is not vacuous: an agent pod given a peer's certificate, or a Secret it does not read, fails it."""
    key = ("agent-edge-fra-1", "agent")
    pod, _ = _container(*key)
    peer = copy.deepcopy(pod)
    pki = next(v for v in peer["volumes"] if v["name"] == "pki")
    pki["projected"]["sources"].append({"secret": {"name": "tiermesh-site-core-eu",
                                                   "items": [{"key": "tls.crt", "path": "sites/core-eu.pem"}]}})
    with pytest.raises(AssertionError, match="core-eu"):
        _check_holds_exactly(key, peer, next(x for x in peer["containers"] if x["name"] == "agent"))
    unread = copy.deepcopy(pod)
    unread["volumes"].append({"name": "spare", "secret": {"secretName": "tiermesh-admin-operator"}})
    with pytest.raises(AssertionError):
        _check_holds_exactly(key, unread, next(x for x in unread["containers"] if x["name"] == "agent"))


def test_etcd_reads_a_list_kept_current() -> None:
    """--client-crl-file on an emptyDir, seeded from tiermesh-trust's crl.pem before etcd starts, rewritten by the
    follower (etcd's identity, etcd's uid, one PID namespace with etcd, so it may signal it)."""
    sts = _named("StatefulSet", "etcd")
    pod = sts["spec"]["template"]["spec"]
    etcd = next(c for c in pod["containers"] if c["name"] == "etcd")
    assert _flag(etcd["args"], "--client-crl-file") == ETCD_CRL
    volumes = {v["name"]: v for v in pod["volumes"]}

    def volume_at(c: Doc, path: str) -> tuple[Doc, Doc]:
        m = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
        return m, volumes[m["name"]]

    mount, vol = volume_at(etcd, ETCD_CRL)
    assert "emptyDir" in vol and mount.get("readOnly") is True
    (seed,) = pod["initContainers"]
    assert seed["command"][0] == "cp" and seed["command"][-1] == ETCD_CRL
    assert _held(pod, seed) == {PurePosixPath(seed["command"][1]): (deploy.TRUST_SECRET, "crl.pem")}
    assert volume_at(seed, ETCD_CRL)[1] is vol
    follower = next(c for c in pod["containers"] if c["name"] == "crl-follower")
    assert _flag(follower["args"], "--out") == ETCD_CRL
    fmount, fvol = volume_at(follower, ETCD_CRL)
    assert fvol is vol and not fmount.get("readOnly")
    assert pod["shareProcessNamespace"] is True
    assert follower["securityContext"]["runAsUser"] == pod["securityContext"]["runAsUser"]  # etcd's
    # the follower's identity is etcd's own certificate, from the Secret etcd serves with
    server = {f: v for f, v in _held(pod, etcd).items() if v[0] == "etcd-server"}
    assert {v for v in _held(pod, follower).values()} == {v for v in server.values()}
    rbac = HOSTS[("etcd-rbac", "etcd-rbac")]
    assert _flag(list(rbac.args), "--crl-follower") == HOSTS[("etcd", "crl-follower")].identity.common_name


def test_rbac_runs_before_the_mesh() -> None:
    """kubectl applies files in name order: the RBAC Job after etcd and the ConfigMaps it reads, before every pod
    that uses etcd as its own identity (until it has run, etcd treats every CA-issued certificate as root)."""
    file_of = {d["metadata"]["name"]: f for f, d in DOCS if d["kind"] in ("Job", "Deployment", "StatefulSet",
                                                                          "ConfigMap")}
    rbac = file_of["etcd-rbac"]
    assert file_of["etcd"] < rbac and file_of[deploy.CONFIG_MAP] < rbac and file_of[deploy.TOPOLOGY_CONFIG_MAP] < rbac
    for name in ("topology-apply", "variant-store", "scheduler", *(w for w, _ in HOSTS if w.startswith("agent-"))):
        assert rbac < file_of[name], name
    assert [p.name for p in MANIFEST_FILES].count(rbac) == 1
    job = _named("Job", "etcd-rbac")
    pod = job["spec"]["template"]["spec"]
    topo = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == TOPOLOGY_IN_POD)
    vol = next(v for v in pod["volumes"] if v["name"] == topo["name"])
    assert vol["configMap"]["name"] == deploy.TOPOLOGY_CONFIG_MAP and topo["subPath"] == deploy.TOPOLOGY_FILE
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"  # retried while etcd forms


def test_the_store_serves_https_as_its_own_identity() -> None:
    _, c = _container("variant-store", "variant-store")
    host = HOSTS[("variant-store", "variant-store")]
    assert host.identity == hosts.STORE_IDENTITY and host.identity.kind == "store"
    assert _flag(c["args"], "--pki-dir") == str(deploy.AGENT_PKI.root)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert "tcpSocket" in c[probe], probe  # a probe cannot present a client certificate
    (port,) = _named("Service", "variant-store")["spec"]["ports"]
    assert port["appProtocol"] == "https"
