"""A local etcd cluster of several members (each an :class:`~mesh.etcd.server.EmbeddedEtcd` with its own
data dir and ports), for ``tiermesh etcd --members 3``, ``tiermesh up`` and the failover tests.

The members are started together (a new member is healthy only once a quorum has met) with
``--initial-cluster`` naming all of them; they can be killed (SIGKILL, a crash) and restarted one by
one, and the cluster says which member leads (each member's ``/v3/maintenance/status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import urllib.error
import uuid
from pathlib import Path

from mesh.errors import EtcdServerError
from mesh.etcd.server import PORTS_FILE, EmbeddedEtcd, ServerTLS, free_port, http_json, port_free
from mesh.lifecycle import Service
from mesh.log import get_logger, kv

__all__ = ["EtcdCluster"]

log = get_logger(__name__)


class EtcdCluster(Service):
    """``size`` members under ``base_dir/m{i}`` (a temp dir, removed on stop, when none is given).
    Ports are remembered in each member's dir, so a cluster started again on the same dirs keeps
    its URLs. Like a single member it can be stopped with ``keep_data=True`` and started again."""

    _restartable = True

    def __init__(self, base_dir: Path | None = None, *, size: int = 3, host: str = "127.0.0.1",
                 unsafe_no_fsync: bool = False, tls: ServerTLS | None = None,
                 start_timeout: float = 30.0) -> None:
        if size < 1:
            raise EtcdServerError(f"an etcd cluster needs at least one member, not {size}")
        self.size = size
        self.host = host
        self.unsafe_no_fsync = unsafe_no_fsync
        self.tls = tls
        self.start_timeout = start_timeout
        self._given_dir = Path(base_dir) if base_dir is not None else None
        self._temp_dir: Path | None = None
        self.members: list[EmbeddedEtcd] = []
        self._keep_data = False

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    @property
    def url(self) -> str:
        """All client URLs, comma-separated (what ``--etcd`` and ``Store.connect`` take)."""
        return ",".join(self.urls)

    def _member_ports(self, d: Path) -> tuple[int, int]:
        saved: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):
            saved = json.loads((d / PORTS_FILE).read_text())
        client, peer = saved.get("client"), saved.get("peer")
        if not (client and peer and port_free(self.host, client) and port_free(self.host, peer)):
            client, peer = free_port(self.host), free_port(self.host)
            while peer == client:
                peer = free_port(self.host)
        return client, peer

    def _build(self) -> None:
        if self._given_dir is None:
            self._temp_dir = Path(tempfile.mkdtemp(prefix="tiermesh-etcd-cluster-"))
        base = self._given_dir or self._temp_dir
        assert base is not None
        dirs = [base / f"m{i}" for i in range(self.size)]
        ports: list[tuple[int, int]] = []
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            ports.append(self._member_ports(d))
        # ports are taken by the members only when they start: two dirs must not pick the same
        while len({p for pair in ports for p in pair}) < 2 * self.size:
            ports = [(free_port(self.host), free_port(self.host)) for _ in dirs]
        scheme = "https" if self.tls else "http"  # members speak TLS to each other when clients do (ServerTLS)
        initial = ",".join(f"m{i}={scheme}://{self.host}:{peer}" for i, (_, peer) in enumerate(ports))
        token_file = base / "cluster-token"
        if not token_file.exists():
            token_file.write_text(f"tiermesh-{uuid.uuid4().hex[:12]}")
        token = token_file.read_text().strip()
        self.members = [
            EmbeddedEtcd(d, host=self.host, client_port=c, peer_port=p, name=f"m{i}",
                         unsafe_no_fsync=self.unsafe_no_fsync, start_timeout=self.start_timeout,
                         initial_cluster=initial, cluster_token=token, tls=self.tls)
            for i, (d, (c, p)) in enumerate(zip(dirs, ports, strict=True))]

    async def _start(self) -> None:
        if not self.members:
            self._build()
        # together: no member reports healthy before a quorum has elected a leader
        results = await asyncio.gather(*(m.start() for m in self.members), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise EtcdServerError(f"etcd cluster did not start: {errors[0]}") from errors[0]
        log.info("etcd cluster started", extra=kv(event="etcd_cluster_start", reason=self.url))

    async def stop(self, *, keep_data: bool = False) -> None:
        """Stop every member. A temp base dir is removed (and the next start builds a new cluster)
        unless ``keep_data``; a given base dir is never removed."""
        self._keep_data = keep_data
        await super().stop()

    async def _stop(self) -> None:
        # One at a time, the leader first: a stopping leader hands leadership over, and a hand-over
        # to a member that is itself stopping hangs for ~7 s; the last member has no quorum to lead.
        running = [i for i, m in enumerate(self.members) if m.running()]
        while running:
            lead = await asyncio.to_thread(self._leader_now, running)
            i = lead if lead is not None else running[0]
            with contextlib.suppress(EtcdServerError):
                await self.members[i].stop(keep_data=True)
            running.remove(i)
        for m in self.members:  # members that had died already: reap them
            with contextlib.suppress(EtcdServerError):
                await m.stop(keep_data=True)
        if self._temp_dir is not None and not self._keep_data:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None
            self.members = []

    # -- faults and introspection -------------------------------------------------------------
    def _status(self, i: int) -> dict[str, object] | None:
        m = self.members[i]
        if not m.running():
            return None
        try:
            status = http_json(m.url, "/v3/maintenance/status", 1.0, body=b"{}", context=m.client_context())
        except (OSError, urllib.error.URLError, ValueError):
            return None
        return status if isinstance(status, dict) else None

    def _leader_now(self, among: list[int]) -> int | None:
        for i in among:
            st = self._status(i)
            header = st.get("header") if st else None
            if st and isinstance(header, dict) and str(st.get("leader")) == str(header.get("member_id")):
                return i
        return None

    async def leader(self, timeout: float = 10.0) -> int:  # noqa: ASYNC109
        """Index of the member that leads now (waits up to ``timeout`` for an election to finish)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            lead = await asyncio.to_thread(self._leader_now, list(range(self.size)))
            if lead is not None:
                return lead
            if loop.time() > deadline:
                raise EtcdServerError(f"no etcd member leads after {timeout:.0f} s")
            await asyncio.sleep(0.1)

    async def move_leader(self, i: int, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Hand leadership to member ``i`` (etcd's MoveLeader), so a test can kill the member its
        clients talk to and be sure it is also the leader."""
        lead = await self.leader(timeout)
        if lead == i:
            return
        status = await asyncio.to_thread(self._status, i)
        header = status.get("header") if status else None
        if not isinstance(header, dict):
            raise EtcdServerError(f"etcd member m{i} does not answer its status")
        m = self.members[lead]
        body = json.dumps({"targetID": str(header["member_id"])}).encode()
        try:
            await asyncio.to_thread(http_json, m.url, "/v3/maintenance/transfer-leadership", timeout, body=body,
                                    context=m.client_context())
        except (OSError, urllib.error.URLError, ValueError) as exc:
            raise EtcdServerError(f"moving the etcd leader to m{i} failed: {exc}") from exc
        if await self.leader(timeout) != i:
            raise EtcdServerError(f"etcd leadership did not move to m{i}")

    async def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data stays for :meth:`restart`)."""
        await self.members[i].kill()
        log.info("etcd member killed", extra=kv(event="etcd_member_kill", reason=self.members[i].url))

    async def restart(self, i: int) -> None:
        """Start member ``i`` again (after :meth:`kill`, or stop it first) on its ports and data."""
        m = self.members[i]
        if m.running():
            await m.stop(keep_data=True)
        await m.start()

    def __repr__(self) -> str:
        return f"EtcdCluster({self.url if self.members else self.size})"
