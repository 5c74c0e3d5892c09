"""Sites that differ: each site's agent gets the compute and model memory its topology entry declares,
scaled to this machine.

- **CPU**: a cgroup per site with a CFS quota (cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, or
  v2 ``cpu.max``, whichever has the ``cpu`` controller and is writable here). Sites that are not core sites
  get the machine's cores in proportion to the cores they declare (never less than :data:`MIN_CPU`); the
  core sites share the rest. An agent is started inside its cgroup (a shell writes its own pid into
  ``cgroup.procs`` and execs the agent), so it runs capped from its first instruction and reads its cap
  back from its own cgroup (:func:`variant_store.hardware.cpu_cap_cores`).
- **Memory**: the model-memory budget the agent enforces, ``memory_mb x model_memory_fraction`` of its
  topology entry, scaled down (never up) so that the budgets of all sites fit in half of this machine's
  available memory.

Where no cgroup controller is writable, :class:`CpuCgroups` says why and the sites run uncapped (and say
so): nothing pretends. Every cgroup made here lives under one parent named for this process and is
removed at :meth:`CpuCgroups.close` (its processes moved to the root first); parents left by a process
that died are removed the next time.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from mesh.errors import ConfigError
from mesh.lifecycle import pid_alive
from mesh.log import get_logger, kv
from topology.schema import Topology

__all__ = ["MIN_CPU", "PERIOD_US", "CpuCgroups", "SiteCaps", "machine_memory_mb", "period_for", "plan_caps"]

log = get_logger(__name__)

MIN_CPU = 0.1            # cores: below this an agent's own event loop (heartbeats, watches) starves
PERIOD_US = 20_000       # the CFS period before issue 30: a throttled site waited up to (1 - share) x 20 ms
MIN_QUOTA_US = 1_000     # the kernel's smallest CFS quota
MIN_PERIOD_US = 2_000    # shorter periods throttle and unthrottle more often for little gain


def period_for(cores: float) -> int:
    """The CFS period of a cap of ``cores``: the shortest that can express it (``MIN_QUOTA_US / cores``, at
    least ``MIN_PERIOD_US``, at most ``PERIOD_US``). A quota runs at full speed then stalls for the rest of its
    period, so the shorter the period the more a capped site looks like a slower CPU and the less like a stalled
    one: at 0.1 core a unit of work waited up to 18 ms at 20 ms, 9 ms at 10 ms (``bench/cap_stalls.py``)."""
    return int(min(PERIOD_US, max(MIN_PERIOD_US, MIN_QUOTA_US / cores)))
_PARENT = "tiermesh-"


@dataclass(frozen=True, slots=True)
class SiteCaps:
    """What one site's agent may use. ``cpu``: cores of this machine (``None``: uncapped);
    ``model_memory_mb``: the model-memory budget its agent enforces."""

    site: str
    tier: str
    declared_cores: int
    declared_memory_mb: int
    cpu: float | None
    model_memory_mb: int
    how: str = ""          # "cgroup v1", "cgroup v2", or why it runs uncapped

    def describe(self) -> str:
        cpu = f"{self.cpu:.2f} CPU" if self.cpu is not None else "CPU uncapped"
        return (f"{cpu} (declares {self.declared_cores}), models {self.model_memory_mb} MiB "
                f"(declares {self.declared_memory_mb} MiB){'; ' + self.how if self.how else ''}")

    def to_json(self) -> dict[str, object]:
        return {"tier": self.tier, "declared_cores": self.declared_cores, "declared_memory_mb": self.declared_memory_mb,
                "cpu": self.cpu, "model_memory_mb": self.model_memory_mb, "how": self.how}


def machine_memory_mb() -> int:
    """``MemAvailable`` of this machine in MiB (0 when /proc/meminfo cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def plan_caps(topology: Topology, names: list[str], *, machine_cpus: float, machine_memory: int,
              model_memory_fraction: float = 0.25, min_cpu: float = MIN_CPU) -> dict[str, SiteCaps]:
    """Each of ``names``' share of this machine (pure: the caller says what the machine has).

    Non-core sites get ``machine_cpus x declared / all declared`` cores (at least ``min_cpu``); core
    sites split what is left by their declared cores (at least ``min_cpu`` each); where the other sites'
    floors alone take the whole machine, a core site gets its own ``machine_cpus x declared / all declared``
    instead (the caps then add up to more than the machine: they are limits, not reservations). Model memory:
    declared x fraction, scaled by ``min(1, machine_memory / 2 / sum of those)`` (MiB)."""
    if machine_cpus <= 0:
        raise ConfigError(f"machine_cpus must be positive, got {machine_cpus}")
    sites = [topology.sites[n] for n in names]
    declared = sum(s.hardware.cpu_cores for s in sites) or 1
    cpu: dict[str, float] = {}
    for s in sites:
        if s.tier != "core":
            cpu[s.name] = max(min_cpu, machine_cpus * s.hardware.cpu_cores / declared)
    cores = [s for s in sites if s.tier == "core"]
    rest = max(machine_cpus - sum(cpu.values()), min_cpu * len(cores))
    core_declared = sum(s.hardware.cpu_cores for s in cores) or 1
    oversubscribed = sum(cpu.values()) >= machine_cpus
    for s in cores:
        # where the other sites' floors alone take the whole machine (many small edges), caps are limits,
        # not reservations: a core keeps its proportional share rather than fall to the floor below them
        fair = machine_cpus * s.hardware.cpu_cores / declared if oversubscribed else 0.0
        cpu[s.name] = max(min_cpu, fair, rest * s.hardware.cpu_cores / core_declared)
    budgets = {s.name: s.hardware.memory_mb * model_memory_fraction for s in sites}
    total = sum(budgets.values()) or 1.0
    scale = min(1.0, machine_memory / 2 / total) if machine_memory > 0 else 1.0
    return {s.name: SiteCaps(site=s.name, tier=s.tier, declared_cores=s.hardware.cpu_cores,
                             declared_memory_mb=s.hardware.memory_mb, cpu=round(min(cpu[s.name], machine_cpus), 3),
                             model_memory_mb=max(1, int(budgets[s.name] * scale)))
            for s in sites}


def _cpu_mounts() -> list[tuple[str, Path]]:
    """(version, mount point) of every cgroup hierarchy here that has the cpu controller."""
    out: list[tuple[str, Path]] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            mount, fstype, options = Path(parts[1]), parts[2], parts[3].split(",")
            if fstype == "cgroup" and "cpu" in options:
                out.append(("v1", mount))
            elif fstype == "cgroup2":
                with contextlib.suppress(OSError):
                    if "cpu" in (mount / "cgroup.controllers").read_text().split():
                        out.append(("v2", mount))
    return out


class CpuCgroups:
    """The per-site CPU cgroups of one harness, under ``<mount>/tiermesh-<pid>``.

    ``available`` says whether caps can be set here; ``why`` what was found when they cannot."""

    def __init__(self, mounts: list[tuple[str, Path]] | None = None) -> None:
        self.version: str | None = None
        self.mount: Path | None = None
        self.parent: Path | None = None
        self.why = ""
        self.sites: dict[str, Path] = {}
        candidates = _cpu_mounts() if mounts is None else mounts
        if not candidates:
            self.why = "no cgroup hierarchy with the cpu controller is mounted"
        for version, mount in candidates:
            try:
                self._open(version, mount)
                break
            except OSError as exc:
                self.why = f"cgroup {version} cpu controller at {mount} is not writable ({exc.strerror or exc})"
        if self.version is not None:
            self.why = ""

    @property
    def available(self) -> bool:
        return self.parent is not None

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """Whether CPU caps can be set here, and if not why (what it made to find out, it removes)."""
        cg = cls()
        try:
            return cg.available, cg.why
        finally:
            cg.close()

    def _open(self, version: str, mount: Path) -> None:
        _remove_stale(mount)
        parent = mount / f"{_PARENT}{os.getpid()}"
        parent.mkdir(exist_ok=True)
        try:
            if version == "v2":
                _enable_cpu(mount)
                _enable_cpu(parent)
            elif not (parent / "cpu.cfs_quota_us").exists():
                raise OSError(0, "no cpu.cfs_quota_us in a new cgroup")
        except OSError:
            with contextlib.suppress(OSError):
                parent.rmdir()
            raise
        self.version, self.mount, self.parent = version, mount, parent

    def create(self, site: str, cores: float, *, period_us: int | None = None) -> Path:
        """A cgroup for ``site`` limited to ``cores`` (made again if it exists), over a CFS period of
        ``period_us`` (default :func:`period_for`); returns its ``cgroup.procs``."""
        if self.parent is None:
            raise ConfigError(f"no CPU caps here: {self.why}")
        if cores <= 0:
            raise ConfigError(f"{site}: a CPU cap must be positive, got {cores}")
        path = self.parent / site
        path.mkdir(exist_ok=True)
        period = period_for(cores) if period_us is None else period_us
        quota = max(MIN_QUOTA_US, int(cores * period))
        try:
            if self.version == "v2":
                (path / "cpu.max").write_text(f"{quota} {period}\n")
            else:
                # a new period with the old quota may be refused (quota > period x parent): quota first, down
                (path / "cpu.cfs_quota_us").write_text("-1\n")
                (path / "cpu.cfs_period_us").write_text(f"{period}\n")
                (path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        except OSError:
            self._rmdir(path)
            raise
        self.sites[site] = path
        return path / "cgroup.procs"

    def procs_file(self, site: str) -> Path:
        """The file a process writes its pid to, to join ``site``'s cgroup (its threads with it)."""
        return self.sites[site] / "cgroup.procs"

    def wrap(self, site: str) -> list[str]:
        """A command prefix that runs the rest of the command line inside ``site``'s cgroup (the shell
        joins it, then execs: the pid, and with it the cgroup, is the command's own)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs_file(site))]

    def remove(self, site: str) -> None:
        path = self.sites.pop(site, None)
        if path is not None:
            self._rmdir(path)

    def close(self) -> None:
        """Remove every cgroup made here (processes still inside are moved to the root first)."""
        for site in list(self.sites):
            self.remove(site)
        if self.parent is not None:
            self._rmdir(self.parent)
            self.parent = None

    def _rmdir(self, path: Path) -> None:
        assert self.mount is not None
        for attempt in range(50):  # a process just killed leaves its cgroup when it is reaped: bounded wait
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                with contextlib.suppress(OSError):
                    for pid in (path / "cgroup.procs").read_text().split():
                        (self.mount / "cgroup.procs").write_text(pid)
                time.sleep(0.02 * min(attempt + 1, 5))
        log.warning("could not remove cgroup %s", path, extra=kv(event="cgroup_leak", path=str(path)))


def _enable_cpu(group: Path) -> None:
    control = group / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        control.write_text("+cpu")


def _remove_stale(mount: Path) -> None:
    """Parents left by a harness that died without its cleanup (its pid is gone)."""
    with contextlib.suppress(OSError):
        for parent in mount.glob(f"{_PARENT}*"):
            pid = parent.name[len(_PARENT):]
            if not pid.isdigit() or pid_alive(int(pid)):
                continue
            for child in parent.iterdir():
                if child.is_dir():
                    with contextlib.suppress(OSError):
                        child.rmdir()
            with contextlib.suppress(OSError):
                parent.rmdir()
