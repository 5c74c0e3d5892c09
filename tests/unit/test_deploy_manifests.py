"""The Kubernetes manifests under deploy/ are valid and consistent, offline: every document against the
pinned Kubernetes version's schema (strict: unknown fields fail), the generated per-site files equal a
fresh render of the example topology as shipped (``tests.helpers.topologies.EXAMPLE``, a copy of
examples/topology.yaml: the README's tour has a newcomer edit that file, which must not fail ``make test``),
and the cross-references a schema cannot see (selectors, Secret and ConfigMap names, etcd member names, the
CLI flags and settings the containers use) hold."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # the dev extra
import pytest
from ruamel.yaml import YAML

from mesh.errors import ConfigError
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.settings import setting_names
from tests.helpers.topologies import EXAMPLE
from tiermesh import deploy, hosts
from tiermesh.cli.main import build_parser
from topology.loader import load_topology_file, parse_topology

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TOPOLOGY = EXAMPLE
KUBERNETES_VERSION = "1.30"  # the oldest release the manifests promise to work on

# flags and settings the manifests may use before the CLI has them (none now: all have landed)
PENDING_FLAGS: dict[str, set[str]] = {}
PENDING_SETTINGS: set[str] = set()

Doc = dict[str, Any]


def _load(path: Path) -> list[Doc]:
    return [d for d in YAML(typ="safe").load_all(path.read_text(encoding="utf-8")) if d is not None]


MANIFEST_FILES = sorted(K8S.glob("*.yaml")) + sorted((K8S / "placeholder-secrets").glob("*.yaml"))
DOCS: list[tuple[str, Doc]] = [(str(p.relative_to(K8S)), d) for p in MANIFEST_FILES for d in _load(p)]


def _kind(kind: str) -> list[Doc]:
    return [d for _, d in DOCS if d["kind"] == kind]


def _named(kind: str, name: str) -> Doc:
    found = [d for d in _kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _pod_templates() -> Iterator[tuple[Doc, Doc]]:
    """(workload, pod template) of every Deployment, StatefulSet and Job."""
    for d in _kind("Deployment") + _kind("StatefulSet") + _kind("Job"):
        yield d, d["spec"]["template"]


def _containers(pod_spec: Doc) -> list[Doc]:
    return list(pod_spec.get("initContainers", [])) + list(pod_spec["containers"])


def _is_tiermesh(container: Doc) -> bool:
    return str(container["image"]).split(":")[0] == deploy.IMAGE.split(":")[0]


def _runs_tiermesh(container: Doc) -> bool:
    """A tiermesh process: the image's entrypoint (etcd's crl-seed uses the image for a plain ``cp``)."""
    return _is_tiermesh(container) and "command" not in container


def test_manifests_found() -> None:
    names = {p.name for p in MANIFEST_FILES}
    assert {"00-namespace.yaml", "20-etcd.yaml", deploy.AGENTS_FILE, deploy.TOPOLOGY_CONFIG_FILE} <= names
    assert len(DOCS) >= 20


@pytest.mark.parametrize(("file", "doc"), DOCS, ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS])
def test_schema_valid(file: str, doc: Doc) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{file}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_strict_schema_catches_a_misspelt_field() -> None:
    """The validator is not vacuous: a typo Kubernetes would silently drop fails strict validation."""
    bad = _named("Deployment", "scheduler")
    bad = {**bad, "spec": {**bad["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_generated_files_are_current() -> None:
    rendered = deploy.render(TOPOLOGY, src="examples/topology.yaml")
    for name, text in rendered.items():
        committed = (K8S / name).read_text(encoding="utf-8")
        assert committed == text, (f"deploy/k8s/{name} is stale against {TOPOLOGY.relative_to(ROOT)} (the example "
                                   f"as shipped): copy examples/topology.yaml there, then python -m tiermesh.deploy "
                                   f"render examples/topology.yaml --out deploy/k8s")


def test_topology_configmap_is_the_example_file() -> None:
    cm = _named("ConfigMap", deploy.TOPOLOGY_CONFIG_MAP)
    assert cm["data"][deploy.TOPOLOGY_FILE] == TOPOLOGY.read_text(encoding="utf-8")
    job = _named("Job", "topology-apply")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["topology", "apply", f"/etc/tiermesh/{deploy.TOPOLOGY_FILE}"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == f"/etc/tiermesh/{deploy.TOPOLOGY_FILE}")
    assert mount["subPath"] == deploy.TOPOLOGY_FILE


def test_every_site_has_its_agent() -> None:
    topo = load_topology_file(TOPOLOGY)
    agents = {d["metadata"]["name"]: d for d in _kind("Deployment")
              if d["metadata"]["labels"].get("app.kubernetes.io/component") == "agent"}
    assert set(agents) == {f"agent-{s}" for s in topo.sites}
    for site in topo.sites.values():
        dep = agents[f"agent-{site.name}"]
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
        pod = dep["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"topology.kubernetes.io/region": site.region, "tiermesh.io/site": site.name}
        (c,) = pod["containers"]
        args = c["args"]
        assert args[args.index("--site") + 1] == site.name
        assert args[args.index("--advertise") + 1] == "$(POD_IP)"
        pod_ip = next(e for e in c["env"] if e["name"] == "POD_IP")
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "--insecure" not in args, "agents are secured: HTTPS with client certificates"
        # the kubelet has no client certificate: no httpGet; readiness asks with the site's own one
        assert c["livenessProbe"]["tcpSocket"]["port"] == c["startupProbe"]["tcpSocket"]["port"] == "https"
        command, ns = _parse(c["readinessProbe"]["exec"]["command"][1:])
        assert c["readinessProbe"]["exec"]["command"][0] == "tiermesh"
        assert (command, ns.probe, ns.site, ns.insecure) == ("agent", True, site.name, False)
        assert ns.http_port == int(_flag(args, "--http-port"))
        # the agent reads its PKI from $TIERMESH_HOME/pki (PkiPaths); exactly those files are mounted there
        home = _env(c)["TIERMESH_HOME"]
        pki, me = PkiPaths.under(home), Identity("site", site.name)
        mounted = _secret_files(pod, c)
        wanted = {pki.ca_cert, pki.crl, pki.cert(me), pki.key(me), pki.curve(me)}
        assert {Path(f) for f in mounted if Path(f).is_relative_to(pki.root)} == wanted, site.name
        assert {mounted[str(pki.cert(me))][0], mounted[str(pki.key(me))][0]} == {deploy.identity_secret(me)}
        assert mounted[str(pki.ca_cert)][0] == mounted[str(pki.crl)][0] == deploy.TRUST_SECRET
        assert {Path(f): v for f, v in mounted.items()} == deploy.agent_pki_files(site.name)
        # and its etcd client certificate is the site's own
        assert (_env(c)["TIERMESH_ETCD_CERT"], _env(c)["TIERMESH_ETCD_KEY"]) == (str(pki.cert(me)), str(pki.key(me)))
        limits = c["resources"]["limits"]
        assert limits["cpu"] == str(site.hardware.cpu_cores)
        assert limits["memory"] == f"{site.hardware.memory_mb}Mi"
        assert limits.get("nvidia.com/gpu", 0) == len(site.hardware.gpus)
        services = [s for s in _kind("Service") if s["spec"].get("selector", {}).get("tiermesh.io/site") == site.name]
        assert bool(services) == (site.tier == "edge"), f"{site.name}: an OIP Service exactly for edge sites"
    # edge boxes are small, the core large: the requests say so too
    sizes = {s.tier: _named("Deployment", f"agent-{s.name}") for s in topo.sites.values()}
    edge_mem = sizes["edge"]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"]
    core_mem = sizes["core"]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"]
    assert int(edge_mem.removesuffix("Mi")) < int(core_mem.removesuffix("Mi"))


def _flag(args: list[str], name: str) -> str:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


def test_etcd_is_a_three_member_cluster_named_by_its_pods() -> None:
    sts = _named("StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == deploy.ETCD_MEMBERS == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # OrderedReady never forms a quorum
    svc = _named("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}.items() >= {"client": 2379, "peer": 2380}.items()
    ns = sts["metadata"]["namespace"]
    domain = f"{svc['metadata']['name']}.{ns}.svc"
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    c = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "etcd")
    args = c["args"]
    members = dict(m.split("=", 1) for m in _flag(args, "--initial-cluster").split(","))
    assert members == {p: f"https://{p}.{domain}:2380" for p in pods}
    assert _flag(args, "--name") == "$(POD_NAME)"
    assert _flag(args, "--initial-advertise-peer-urls") == f"https://$(POD_NAME).{domain}:2380"
    assert _flag(args, "--advertise-client-urls") == f"https://$(POD_NAME).{domain}:2379"
    pod_name = next(e for e in c["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args
    # the data dir lives on the claimed volume
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    data_mount = next(m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert _flag(args, "--data-dir").startswith(data_mount["mountPath"] + "/")
    # TLS files come from mounted Secrets holding those keys
    for flag in ("--trusted-ca-file", "--cert-file", "--key-file",
                 "--peer-trusted-ca-file", "--peer-cert-file", "--peer-key-file"):
        _assert_file_from_secret(sts["spec"]["template"]["spec"], c, _flag(args, flag))
    # etcd >= 3.5.3 (3.5.0-3.5.2 have a data-inconsistency bug)
    m = re.fullmatch(r".*:v(\d+)\.(\d+)\.(\d+)", c["image"])
    assert m is not None and tuple(map(int, m.groups())) >= (3, 5, 3), c["image"]
    # every client is given every member, on the client port
    config = _named("ConfigMap", deploy.CONFIG_MAP)["data"]
    assert config["TIERMESH_ETCD"] == deploy.ETCD_URLS
    assert config["TIERMESH_ETCD"].split(",") == [f"https://{p}.{domain}:2379" for p in pods]
    assert _named("PodDisruptionBudget", "etcd")["spec"]["minAvailable"] == 2


def _env(container: Doc) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env (which wins)."""
    out: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        out |= _named("ConfigMap", ref["configMapRef"]["name"])["data"]
    return out | {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _secret_sources(volume: Doc) -> list[Doc]:
    """The Secret references of a ``secret`` or ``projected`` volume, as {name, items?}."""
    if "secret" in volume:
        return [{"name": volume["secret"]["secretName"], **({"items": volume["secret"]["items"]}
                                                             if "items" in volume["secret"] else {})}]
    return [src["secret"] for src in volume.get("projected", {}).get("sources", []) if "secret" in src]


def _secret_files(pod: Doc, container: Doc) -> dict[str, tuple[str, str]]:
    """Every file the container sees from a Secret: its path -> (Secret, key). Without ``items`` a Secret
    volume shows every key of the Secret under its own name."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files: dict[str, tuple[str, str]] = {}
    for m in container.get("volumeMounts", []):
        for src in _secret_sources(volumes.get(m["name"], {})):  # claim templates are not pod volumes
            secret = _named("Secret", src["name"])
            keys = {**secret.get("data", {}), **secret.get("stringData", {})}
            items = src.get("items") or [{"key": k, "path": k} for k in keys]
            for item in items:
                assert item["key"] in keys, f"{container['name']}: Secret {src['name']} has no key {item['key']}"
                files[f"{m['mountPath'].rstrip('/')}/{item['path']}"] = (src["name"], item["key"])
    return files


def _assert_file_from_secret(pod: Doc, container: Doc, path: str) -> None:
    assert path in _secret_files(pod, container), f"{container['name']}: {path} is not a file from a Secret"


def test_tiermesh_pods_find_their_etcd_certificates() -> None:
    config = _named("ConfigMap", deploy.CONFIG_MAP)["data"]
    seen = 0
    for _, tpl in _pod_templates():
        for c in _containers(tpl["spec"]):
            if not _runs_tiermesh(c):
                continue
            assert {"configMapRef": {"name": deploy.CONFIG_MAP}} in c.get("envFrom", []), c["name"]
            env = _env(c)
            assert env["TIERMESH_ETCD"] == config["TIERMESH_ETCD"]
            for key in ("TIERMESH_ETCD_CA", "TIERMESH_ETCD_CERT", "TIERMESH_ETCD_KEY"):
                _assert_file_from_secret(tpl["spec"], c, env[key])
            seen += 1
    assert seen >= 10


def test_service_selectors_and_ports_match_pods() -> None:
    templates = [(d["metadata"]["namespace"], t) for d, t in _pod_templates()]
    for svc in _kind("Service"):
        selector = svc["spec"]["selector"]
        ns = svc["metadata"]["namespace"]
        pods = [t for n, t in templates if n == ns and selector.items() <= t["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']}: selector {selector} matches no pod"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in pods:
                declared = {p["name"] if isinstance(target, str) else p["containerPort"]
                            for c in pod["spec"]["containers"] for p in c.get("ports", [])}
                assert target in declared, f"Service {svc['metadata']['name']}: port {target} not on a selected pod"
    for d in _kind("Deployment") + _kind("StatefulSet"):
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    for pdb in _kind("PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= t["metadata"]["labels"].items() for _, t in templates), pdb["metadata"]["name"]


def test_probes_use_declared_ports() -> None:
    seen = 0
    for _, tpl in _pod_templates():
        for c in tpl["spec"]["containers"]:
            names = {p["name"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe not in c:
                    continue
                handler = c[probe].get("httpGet") or c[probe].get("tcpSocket")
                if handler is not None:
                    assert handler["port"] in names, f"{c['name']}.{probe}"
                else:  # an exec probe: a real command of the image (args checked against the CLI)
                    command = c[probe]["exec"]["command"]
                    assert _is_tiermesh(c) and command[0] == "tiermesh", f"{c['name']}.{probe}: {command}"
                    _parse(command[1:])
                seen += 1
    assert seen >= 10


def test_every_reference_exists() -> None:
    secrets = {d["metadata"]["name"] for d in _kind("Secret")}
    configmaps = {d["metadata"]["name"]: d for d in _kind("ConfigMap")}
    claims = {d["metadata"]["name"] for d in _kind("PersistentVolumeClaim")}
    for workload, tpl in _pod_templates():
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        spec = tpl["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            for src in _secret_sources(v):
                assert src["name"] in secrets, f"{where}: Secret {src['name']}"
            for src in v.get("projected", {}).get("sources", []):
                assert set(src) <= {"secret", "configMap"}, f"{where}: projected {set(src)}"
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, f"{where}: ConfigMap {v['configMap']['name']}"
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, f"{where}: claim"
        claimed = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for c in _containers(spec):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes or m["name"] in claimed, f"{where}: volume {m['name']}"
                if "subPath" in m and "configMap" in volumes.get(m["name"], {}):
                    assert m["subPath"] in configmaps[volumes[m["name"]]["configMap"]["name"]]["data"]
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] in configmaps, f"{where}: envFrom"
            # $(VAR) in args is expanded by the kubelet only if VAR is defined in the container's env
            defined = {e["name"] for e in c.get("env", [])}
            for var in re.findall(r"\$\((\w+)\)", " ".join(c.get("args", []))):
                assert var in defined, f"{where}/{c['name']}: $({var}) has no env entry"


def test_settings_named_exist() -> None:
    known = {f"TIERMESH_{name.upper()}" for name in setting_names()}
    used: set[str] = set()
    for cm in _kind("ConfigMap"):
        used |= {k for k in cm.get("data", {}) if k.startswith("TIERMESH_")}
    for _, tpl in _pod_templates():
        for c in _containers(tpl["spec"]):
            used |= {e["name"] for e in c.get("env", []) if e["name"].startswith("TIERMESH_")}
    assert "TIERMESH_ETCD" in used
    assert used <= known | PENDING_SETTINGS, used - known - PENDING_SETTINGS


def _command(parser: argparse.ArgumentParser, args: list[str]) -> tuple[list[str], argparse.ArgumentParser]:
    """The (sub)command words at the head of ``args`` and the parser of the innermost one."""
    words: list[str] = []
    for word in args:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None or word not in action.choices:
            break
        parser = action.choices[word]
        words.append(word)
    return words, parser


def _parse(args: list[str]) -> tuple[str, argparse.Namespace]:
    """Parse a container's args as the entrypoint would, minus pending flags the CLI does not know yet."""
    parser = build_parser()
    words, sub = _command(parser, args)
    command = " ".join(words)
    known = set(sub._option_string_actions)
    kept: list[str] = []
    it = iter(args)
    for a in it:
        flag = a.split("=", 1)[0]
        if flag in PENDING_FLAGS.get(command, set()) and flag not in known:
            if "=" not in a:
                next(it)  # its value
            continue
        kept.append(a)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return command, parser.parse_args(kept)
    except SystemExit:
        pytest.fail(f"`tiermesh {' '.join(args)}`: {err.getvalue().strip()}")


def test_container_args_are_real_cli_flags() -> None:
    commands: set[str] = set()
    for _, tpl in _pod_templates():
        for c in _containers(tpl["spec"]):
            if not _is_tiermesh(c):
                continue
            if not _runs_tiermesh(c):  # the one utility use of the image: seeding etcd's revocation list
                assert c["name"] == "crl-seed" and c["command"][0] == "cp", c["name"]
                continue
            command, ns = _parse(c["args"])
            commands.add(command)
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            if command == "agent":
                assert (ns.http_port, ns.zmq_port) == (ports["https"], ports["zmq"]) == (hosts.AGENT_HTTP_PORT,
                                                                                          hosts.AGENT_ZMQ_PORT)
            if command == "variants serve":
                assert ns.port == ports["https"] == hosts.STORE_PORT
            if command == "scheduler":
                assert ns.console_port == ports["console"] == hosts.CONSOLE_PORT
    assert commands == {"agent", "scheduler", "variants serve", "topology apply", "etcd-rbac", "pki follow-crl"}


def test_the_parse_check_rejects_an_unknown_flag() -> None:
    with pytest.raises(pytest.fail.Exception, match="--no-such-flag"):
        _parse(["agent", "--site", "x", "--no-such-flag", "1"])


def test_variant_store_is_reachable_where_it_announces_itself() -> None:
    topo = load_topology_file(TOPOLOGY)
    dep = _named("Deployment", "variant-store")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    svc = _named("Service", "variant-store")
    assert _flag(c["args"], "--advertise") == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    # agents dial the announced port on the Service: the Service must listen on that same port
    assert int(_flag(c["args"], "--port")) in {p["port"] for p in svc["spec"]["ports"]}
    site = topo.sites[_flag(c["args"], "--site")]
    assert site.tier == "core"
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == {"topology.kubernetes.io/region": site.region,
                                                               "tiermesh.io/site": site.name}
    assert dep["spec"]["strategy"]["type"] == "Recreate"  # ReadWriteOnce blobs
    scheduler = _named("Deployment", "scheduler")
    assert scheduler["spec"]["replicas"] == 2
    assert scheduler["spec"]["template"]["spec"]["nodeSelector"]["topology.kubernetes.io/region"] == site.region


def test_pods_are_restricted() -> None:
    """Pod Security 'restricted' (the namespace enforces it) plus a read-only root filesystem."""
    ns = _named("Namespace", deploy.NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for workload, tpl in _pod_templates():
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        pod = tpl["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        assert pod.get("automountServiceAccountToken") is False, where
        for c in _containers(pod):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "limits" in c["resources"] and "requests" in c["resources"], where
            if _runs_tiermesh(c):
                # the image's user, except beside etcd: the CRL follower runs as etcd's user to signal it
                uid = sc.get("runAsUser", pod["securityContext"]["runAsUser"])
                etcd_uid = pod["securityContext"]["runAsUser"] if workload["metadata"]["name"] == "etcd" else None
                assert uid in (deploy.UID, etcd_uid), where
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                assert {deploy.HOME, "/tmp"} <= mounts, f"{where}: the writable places of a read-only root"


def test_everything_is_in_the_namespace() -> None:
    for file, d in DOCS:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == deploy.NAMESPACE, f"{file}: {d['kind']}/{d['metadata']['name']}"


# where each kind of pod really serves /metrics (edge_agent/observe.py, variant_store/server.py, and the scheduler
# only through its console): every one HTTPS with client certificates
METRICS = {"tiermesh-agent-metrics": ("tiermesh-agent", hosts.AGENT_HTTP_PORT),
           "tiermesh-store-metrics": ("tiermesh-variant-store", hosts.STORE_PORT),
           "tiermesh-scheduler-metrics": ("tiermesh-scheduler", hosts.CONSOLE_PORT)}


def test_metrics_services_point_where_metrics_are_served() -> None:
    services = {d["metadata"]["name"]: d for d in _kind("Service")
                if d["metadata"]["labels"].get("app.kubernetes.io/name") == "tiermesh-metrics"}
    assert set(services) == set(METRICS)
    for name, (app, port) in METRICS.items():
        svc = services[name]
        assert svc["spec"]["clusterIP"] == "None", name  # headless: Prometheus scrapes every pod
        selector = svc["spec"]["selector"].items()
        selected = [t for _, t in _pod_templates() if selector <= t["metadata"]["labels"].items()]
        assert {t["metadata"]["labels"]["app.kubernetes.io/name"] for t in selected} == {app}, name
        (sp,) = svc["spec"]["ports"]
        assert sp["port"] == port and sp["appProtocol"] == "https", name
        for t in selected:
            ports = {p["name"]: p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
            assert ports[sp["targetPort"]] == port, name
    # nothing declares a port that nothing serves (the old placeholder 9100)
    for _, t in _pod_templates():
        for c in _containers(t["spec"]):
            assert all(p["containerPort"] != 9100 for p in c.get("ports", [])), c["name"]


def test_render_refuses_names_kubernetes_cannot_take() -> None:
    long = "edge-" + "x" * 53  # a valid topology name (58 characters), one too long behind "agent-"
    text = TOPOLOGY.read_text(encoding="utf-8").replace("edge-sin-1", long)
    topo = parse_topology(text)
    with pytest.raises(ConfigError, match=long):
        deploy.agent_documents(topo)


def test_render_check_reports_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert deploy.main(["render", str(TOPOLOGY), "--out", str(tmp_path)]) == 0
    assert deploy.main(["render", str(TOPOLOGY), "--out", str(tmp_path), "--check"]) == 0
    agents = tmp_path / deploy.AGENTS_FILE
    agents.write_text(agents.read_text().replace("'8000'", "'8001'"))
    assert deploy.main(["render", str(TOPOLOGY), "--out", str(tmp_path), "--check"]) == 1
    assert deploy.AGENTS_FILE in capsys.readouterr().err


def test_containerfile_installs_this_tree() -> None:
    recipe = (ROOT / "deploy" / "Containerfile").read_text(encoding="utf-8")
    # one recipe for python:3.11-slim and an offline Debian base (make deploy-check): the base is a build argument
    assert re.search(r"^ARG BASE=python:3\.11-slim$", recipe, re.M)
    assert re.findall(r"^FROM (\S+)", recipe, re.M) == ["${BASE}", "${BASE}"]
    assert 'ENTRYPOINT ["tiermesh"]' in recipe
    assert re.search(rf"^USER {deploy.UID}:{deploy.UID}$", recipe, re.M)
    assert f"TIERMESH_HOME={deploy.HOME}" in recipe
    ignored = {line.strip() for line in (ROOT / ".containerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    sources = [s for line in re.findall(r"^COPY (?!--from)(.+)$", recipe, re.M) for s in line.split()[:-1]]
    assert "pyproject.toml" in sources and "tiermesh/" in sources
    # every package setuptools installs is copied (console/ was once forgotten: tiermesh imports it)
    packages = re.search(r"^include = \[(.+)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert packages is not None
    assert {p.strip(' "*') + "/" for p in packages.group(1).split(",")} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), src
        assert src.rstrip("/") not in ignored, f"{src} is copied but .containerignore drops it"
    assert (ROOT / ".dockerignore").resolve() == (ROOT / ".containerignore").resolve()


def test_no_test_reads_the_topology_the_readme_has_users_edit() -> None:
    """The README's tour edits a link of examples/topology.yaml: a test that read it (this module's render did)
    failed ``make test`` for a newcomer who followed the tour. Tests read the copy, ``tests.helpers.topologies``."""
    used = re.compile(r'"examples"\s*/\s*"topology\.yaml"|"examples/topology\.yaml"')
    readers = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
               if p.name != Path(__file__).name and used.search(p.read_text(encoding="utf-8"))]
    assert readers == [], readers
