"""The faults a chaos run injects, each as an ``inject`` then (after its duration) a ``heal``, on a real
local mesh (:class:`ChaosMesh`: :class:`tiermesh.harness.LocalMesh` with its schedulers as child
processes, so that the leader can be killed like any other process).

Kinds (``Fault.kind``; ``target`` is a site, a link ``A-B``, or empty where there is one of it):

    agent_kill      SIGKILL a site's agent; heal: start it again (its lease must expire meanwhile)
    agent_stop      SIGSTOP a site's agent (alive to TCP, silent to everything); heal: SIGCONT
    leader_kill     SIGKILL the scheduler replica that leads; heal: start a replica under its id
    leader_stop     SIGSTOP the leading replica; heal: SIGCONT (it finds it lost the lead, or kept it)
    etcd_kill       SIGKILL etcd; heal: start it again on its data dir and ports
    etcd_stop       SIGSTOP etcd; heal: SIGCONT
    link_cut        every path over link A-B resets its connections; heal: restore
    link_blackhole  ... its packets vanish, connections stay open (a gray failure); heal: restore
    slow_site       a site's agent held to ``CPU_QUOTA`` of a core (cgroup v1 ``cpu.cfs_quota_us``,
                    or v2 ``cpu.max``); where neither is writable, SIGSTOP bursts of 50 ms in 100 ms
    compaction      a site's agent stopped (its watch goes dark) while the others write and etcd is
                    compacted past its watch revision; heal: SIGCONT (it must re-read, not replay)
    topology_link   ``tiermesh topology apply`` of the topology with link A-B's latency doubled;
                    heal: apply the original
    corrupt_blob    every copy (the store's, other sites' caches) of each blob the site holds is
                    corrupted and the site's agent restarted with an empty cache: its loads fail the
                    digest check, wherever they fetch from; heal: restore every copy
    load_error      the site's agent restarted with the cache path of each blob it needs occupied (a
                    directory in the way): loads fail with ``runtime_load``; heal: paths freed
    burst           ``BURST`` concurrent queries at one edge (past the tenant's in-flight quota and the
                    workload's own cap) and a request larger than any batch queue (typed 429 / 413)

Everything a fault changes is undone by its heal, and :meth:`ChaosMesh.stop` heals whatever a failed
run left (SIGCONT, cgroup removed, blob restored) before it stops the mesh.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from mesh.errors import ConfigError, MeshError
from mesh.etcd.keys import live_key
from mesh.log import get_logger, kv
from tiermesh.chaos.cgroup import CpuCap
from tiermesh.control import terminate
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import logs_dir
from tiermesh.secure import SCHEDULER
from topology.store_io import apply as apply_topology

__all__ = ["KINDS", "ChaosMesh", "Fault"]

log = get_logger(__name__)
KINDS = ("agent_kill", "agent_stop", "leader_kill", "leader_stop", "etcd_kill", "etcd_stop", "link_cut",
         "link_blackhole", "slow_site", "compaction", "topology_link", "corrupt_blob", "load_error", "burst")
CPU_QUOTA = 0.1  # of one core, for slow_site
SCHEDULERS = 2   # replicas; one leads


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    at_s: float          # into the workload
    duration_s: float    # from inject to heal
    target: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown fault kind {self.kind!r}; known: {', '.join(KINDS)}")

    @property
    def label(self) -> str:
        return f"{self.kind} {self.target}".strip()


@dataclass(slots=True)
class _Replica:
    candidate_id: str
    proc: asyncio.subprocess.Process | None = None


@dataclass(slots=True)
class ChaosMesh:
    """A started :class:`LocalMesh` (``scheduler=False``) plus scheduler replicas in child processes."""

    mesh: LocalMesh
    replicas: list[_Replica] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)          # pids under SIGSTOP
    caps: dict[str, CpuCap] = field(default_factory=dict)
    corrupted: dict[Path, bytes] = field(default_factory=dict)  # blob path -> its good bytes
    broken_caches: set[Path] = field(default_factory=set)

    async def start_schedulers(self) -> None:
        for i in range(SCHEDULERS):
            rep = _Replica(f"chaos-{os.getpid()}-{i}")
            self.replicas.append(rep)
            await self._spawn(rep)

    async def _spawn(self, rep: _Replica) -> None:
        m = self.mesh
        cmd = [sys.executable, "-m", "tiermesh", "scheduler", "--etcd", m.etcd_url, "--prefix", m.opts.prefix,
               "--home", str(m.opts.home), "--id", rep.candidate_id, "--election-ttl", "3", "--interval", "1",
               *(m.creds.etcd_args(SCHEDULER) if m.creds is not None else [])]  # a TLS mesh: etcd as its role
        path = logs_dir(m.opts.home) / f"scheduler-{rep.candidate_id}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        logf = path.open("ab")
        try:
            rep.proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=logf, stderr=logf, stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, "TIERMESH_LOG_LEVEL": m.opts.agent_log_level})
        finally:
            logf.close()

    async def leader(self) -> _Replica:
        assert self.mesh.store is not None
        kvs = await self.mesh.store.get_prefix("election/scheduler/")
        if kvs:
            first = min(kvs, key=lambda x: x.create_revision)
            cid = first.value.get("candidate") if isinstance(first.value, dict) else first.value
            for rep in self.replicas:
                if rep.candidate_id == cid and rep.proc is not None:
                    return rep
        raise MeshError(f"no live scheduler replica leads (election keys: {[k.value for k in kvs]})")

    # -- signals ---------------------------------------------------------------------------
    def _signal(self, pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        elif sig == signal.SIGCONT:
            self.stopped.discard(pid)

    def agent_pid(self, site: str) -> int:
        proc = self.mesh.sites[site].proc
        if proc is None or proc.returncode is not None:
            raise MeshError(f"agent {site} is not running")
        return proc.pid

    def etcd_pid(self) -> int:
        pid = getattr(self.mesh.etcd, "pid", None)
        if not isinstance(pid, int):
            raise MeshError("etcd is not running (or is a cluster: etcd_kill/etcd_stop take one member)")
        return pid

    # -- faults ----------------------------------------------------------------------------
    async def inject(self, f: Fault) -> dict[str, object]:
        """Inject ``f``; returns what it did (for the report)."""
        m = self.mesh
        if f.kind == "agent_kill":
            await m.kill_site(f.target)
        elif f.kind in ("agent_stop", "compaction"):
            self._signal(self.agent_pid(f.target), signal.SIGSTOP)
            if f.kind == "compaction":
                return await self._compact_while_dark(f)
        elif f.kind == "leader_kill":
            rep = await self.leader()
            assert rep.proc is not None
            await terminate(rep.proc, graceful=False)
            rep.proc = None
            return {"leader": rep.candidate_id}
        elif f.kind == "leader_stop":
            rep = await self.leader()
            assert rep.proc is not None
            self._signal(rep.proc.pid, signal.SIGSTOP)
            return {"leader": rep.candidate_id}
        elif f.kind == "etcd_kill":
            self._signal(self.etcd_pid(), signal.SIGKILL)
        elif f.kind == "etcd_stop":
            self._signal(self.etcd_pid(), signal.SIGSTOP)
        elif f.kind in ("link_cut", "link_blackhole"):
            a, b = self._link(f.target)
            pairs = await m.drill("cut" if f.kind == "link_cut" else "blackhole", a, b)
            return {"paths": [f"{s}->{d}" for s, d in pairs]}
        elif f.kind == "slow_site":
            cap = CpuCap(f"tiermesh-chaos-{f.target}-{os.getpid()}", CPU_QUOTA)
            self.caps[f.target] = cap
            return {"how": await cap.hold(self.agent_pid(f.target))}
        elif f.kind == "topology_link":
            a, b = self._link(f.target)
            topo = m.topology
            links = [replace(lk, latency_ms=lk.latency_ms * 2) if set(lk.ends) == {a, b} else lk for lk in topo.links]
            assert m.store is not None
            diff = await apply_topology(m.store, replace(topo, links=tuple(links)))
            return {"diff": str(diff)}
        elif f.kind == "corrupt_blob":
            return await self._corrupt_and_restart(f.target)
        elif f.kind == "load_error":
            return await self._break_cache_and_restart(f.target)
        return {}

    async def heal(self, f: Fault) -> None:
        m = self.mesh
        if f.kind == "agent_kill":
            await m.start_site(f.target)
        elif f.kind in ("agent_stop", "compaction"):
            self._signal(self.agent_pid(f.target), signal.SIGCONT)
        elif f.kind == "leader_kill":
            for rep in self.replicas:
                if rep.proc is None:
                    await self._spawn(rep)
        elif f.kind == "leader_stop":
            for rep in self.replicas:
                if rep.proc is not None and rep.proc.pid in self.stopped:
                    self._signal(rep.proc.pid, signal.SIGCONT)
        elif f.kind == "etcd_kill":
            await m.stop_etcd(keep_store=True)  # reaps the killed process
            await m.start_etcd()
        elif f.kind == "etcd_stop":
            self._signal(self.etcd_pid(), signal.SIGCONT)
        elif f.kind in ("link_cut", "link_blackhole"):
            await m.heal(*self._link(f.target))
        elif f.kind == "slow_site":
            cap = self.caps.pop(f.target, None)
            if cap is not None:
                await cap.release()
        elif f.kind == "topology_link":
            assert m.store is not None
            await apply_topology(m.store, m.topology)
        elif f.kind == "corrupt_blob":
            self._restore_blobs()
        elif f.kind == "load_error":
            self._restore_caches()  # the agent's reconcile loop (every <= 5 s) loads again

    def _link(self, target: str) -> tuple[str, str]:
        for lk in self.mesh.topology.links:
            a, b = lk.ends
            if target in (f"{a}-{b}", f"{b}-{a}"):
                return a, b
        raise ConfigError(f"{target!r} is no link of the topology")

    async def _compact_while_dark(self, f: Fault) -> dict[str, object]:
        """The stopped agent's watch misses writes (others' heartbeats, and a churn key of ours) that
        etcd then compacts away: on SIGCONT its watch resumes at a compacted revision."""
        store = self.mesh.store
        assert store is not None
        await asyncio.sleep(min(1.5, f.duration_s / 2))  # heartbeats go on meanwhile
        for i in range(5):
            await store.put(f"chaos/churn/{i}", {"i": i})
        await store.delete_prefix("chaos/churn/")
        rev = await store.revision()
        await store.compact(rev)
        return {"compacted_at": rev}

    async def _corrupt_and_restart(self, site: str) -> dict[str, object]:
        """Flip a byte of the store's copy of each blob ``site`` holds, then restart ``site`` with an
        empty cache: it must fetch them again, and every fetch fails its digest check."""
        m = self.mesh
        assert m.blobs is not None
        loaded, blobs = await self._held_digests(site)
        for digest, fmt in blobs:
            # every copy: the store's and each other site's cache (peers serve theirs, edge_agent.blobs)
            copies = [m.blobs.path(digest), *(m.opts.home / "sites" / s / "blobs" / f"{digest}.{fmt}"
                                              for s in m.sites if s != site)]
            for path in copies:
                if path.is_file() and path not in self.corrupted:
                    good = path.read_bytes()
                    self.corrupted[path] = good
                    os.chmod(path, 0o644)
                    path.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])
        await m.kill_site(site)
        shutil.rmtree(m.opts.home / "sites" / site / "blobs", ignore_errors=True)
        await m.start_site(site)
        return {"variants": loaded, "blobs": len(blobs)}

    def _restore_blobs(self) -> None:
        for path, good in list(self.corrupted.items()):
            os.chmod(path, 0o644)
            path.write_bytes(good)
            del self.corrupted[path]

    async def _held_digests(self, site: str) -> tuple[list[str], set[tuple[str, str]]]:
        """The variants ``site`` holds, and (digest, format) of every blob they need (bases too)."""
        m = self.mesh
        assert m.store is not None and m.catalog is not None
        live = await m.store.get(live_key(site))
        loaded = sorted((live.value.get("loaded") or {}) if live is not None else {})
        blobs: set[tuple[str, str]] = set()
        for meta in await m.catalog.list_variants():
            if meta.variant_id in loaded:
                blobs.add((meta.blob_digest, meta.format))
                if meta.shared_base_digest:
                    blobs.add((meta.shared_base_digest, "onnx"))
        return loaded, blobs

    async def _break_cache_and_restart(self, site: str) -> dict[str, object]:
        """Restart ``site`` with the cache path of each blob it needs occupied by a directory: the
        download verifies, then cannot be put in place (an OS error, as a failing disk gives), so
        every load fails in the runtime layer (``runtime_load``)."""
        m = self.mesh
        loaded, blobs = await self._held_digests(site)
        cache = m.opts.home / "sites" / site / "blobs"
        await m.kill_site(site)
        shutil.rmtree(cache, ignore_errors=True)
        for digest, fmt in blobs:
            bad = cache / f"{digest}{'.tflite' if fmt == 'tflite' else '.onnx'}"
            (bad / "occupied").mkdir(parents=True, exist_ok=True)
            self.broken_caches.add(bad)
        await m.start_site(site)
        return {"variants": loaded, "blobs": len(blobs)}

    def _restore_caches(self) -> None:
        for bad in list(self.broken_caches):
            shutil.rmtree(bad, ignore_errors=True)
            self.broken_caches.discard(bad)

    async def stop(self) -> None:
        """Undo what a fault left (a failed run), stop the replicas; the caller stops the mesh."""
        for pid in list(self.stopped):
            self._signal(pid, signal.SIGCONT)
        for cap in self.caps.values():
            with contextlib.suppress(Exception):
                await cap.release()
        self.caps.clear()
        self._restore_blobs()
        self._restore_caches()
        for rep in self.replicas:
            if rep.proc is not None:
                with contextlib.suppress(Exception):
                    await terminate(rep.proc, graceful=True, grace_s=10.0)
                rep.proc = None
        log.info("chaos mesh healed and its schedulers stopped", extra=kv(event="chaos_stop"))
