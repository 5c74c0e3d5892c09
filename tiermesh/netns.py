"""Network namespaces for ``tiermesh up --netns``: every participant its own host on one bridge.

A :class:`NetnsLab` creates, for one run, a Linux bridge with a private /24 that no route of this
machine uses yet, gives the root namespace the first address on it (``.1``: the harness's delay
proxies listen there, and its own clients leave by the bridge, never by the default route), and
one namespace per role (etcd, the control services, each site) joined to the bridge by a veth
pair, with one address each and no default route: a packet from a namespace can reach the bridge's
subnet and nothing else. :meth:`NetnsLab.check_route` proves, with ``ip route get``, that an
address is reached through the bridge before anyone in the root namespace dials it.

Drills (:meth:`NetnsLab.block`): ``cut`` answers the blocked traffic with a TCP reset (a link
that fails loudly), ``blackhole`` drops it without a word (packets vanish; only timeouts and
heartbeats notice). Both are iptables rules inside the namespaces, so they go with them.

Everything the lab creates carries its owner's pid in the name (``tmx<pid>...``); stopping removes
it all, in reverse order, even after a failed start; a start first removes what runs whose owner
is dead left behind (a SIGKILLed harness). Needs root, ``ip`` and, for drills, ``iptables``:
:func:`unavailable_reason` says which is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
from dataclasses import dataclass
from typing import Literal

from mesh.errors import ConfigError, MeshError
from mesh.lifecycle import Service, pid_alive
from mesh.log import get_logger, kv

__all__ = ["DrillKind", "NetnsLab", "NsHost", "cleanup_stale", "require_netns", "unavailable_reason"]

log = get_logger(__name__)
DrillKind = Literal["cut", "blackhole"]
PREFIX = "tmx"                     # every namespace / interface of a lab starts with tmx<pid>
POOL = ipaddress.ip_network("10.77.0.0/16")  # private /24s are taken from here
_STALE = re.compile(rf"^{PREFIX}(\d+)")
_labs = itertools.count()
_LETTERS = "abcdefghij"  # a lab's letter ends the pid in its names, so the pid parses back


async def _run(*cmd: str, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if check and proc.returncode != 0:
        raise MeshError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {err.decode(errors='replace').strip()}")
    return out.decode(errors="replace")


def unavailable_reason(*, firewall: bool = False) -> str | None:
    """Why network namespaces cannot be used here (None: they can). ``firewall``: drills need iptables."""
    if os.geteuid() != 0:
        return "not root: namespaces, veth pairs and bridges need CAP_NET_ADMIN (run as root, or drop --netns)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if firewall and shutil.which("iptables") is None:
        return "`iptables` is not installed (--cut / --blackhole drop packets with it inside the namespaces)"
    return None


async def require_netns(*, firewall: bool = False) -> None:
    """Refuse with the reason unless namespaces can be made here (probes one, then removes it)."""
    reason = unavailable_reason(firewall=firewall)
    if reason is None:
        probe = f"{PREFIX}{os.getpid()}probe"
        try:
            await _run("ip", "netns", "add", probe)
        except MeshError as exc:
            reason = f"`ip netns add` is not permitted here: {exc}"
        finally:
            await _run("ip", "netns", "del", probe, check=False)
    if reason is not None:
        raise ConfigError(f"--netns is unavailable: {reason}")


async def cleanup_stale() -> list[str]:
    """Remove namespaces and interfaces of labs whose owning process is gone (and kill what still
    runs inside those namespaces: it belonged to the dead run). Returns what was removed."""
    removed: list[str] = []
    for line in (await _run("ip", "netns", "list", check=False)).splitlines():
        name = line.split()[0] if line.split() else ""
        m = _STALE.match(name)
        if not m or pid_alive(int(m.group(1))):
            continue
        for pid in (await _run("ip", "netns", "pids", name, check=False)).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        await _run("ip", "netns", "del", name, check=False)
        removed.append(name)
    for line in (await _run("ip", "-o", "link", "show", check=False)).splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        ifname = parts[1].strip().split("@")[0]
        m = _STALE.match(ifname)
        if m and not pid_alive(int(m.group(1))):
            await _run("ip", "link", "del", ifname, check=False)
            removed.append(ifname)
    if removed:
        log.warning("removed leftovers of a dead run: %s", ", ".join(removed), extra=kv(event="netns_stale"))
    return removed


@dataclass(frozen=True, slots=True)
class NsHost:
    """One participant's host: a namespace, its address on the lab bridge, its root-side veth."""

    role: str
    netns: str
    address: str
    veth: str

    def exec_prefix(self) -> list[str]:
        """Prepend to a command line to run it inside this host (``ip netns exec`` execs, so the
        child's pid is the command's own)."""
        return ["ip", "netns", "exec", self.netns]


class NetnsLab(Service):
    """A bridge, the root namespace's address on it, and one namespace per role (see the module)."""

    def __init__(self, roles: list[str]) -> None:
        if len(set(roles)) != len(roles):
            raise ConfigError(f"duplicate roles in {roles}")
        if len(roles) > 200:
            raise ConfigError(f"{len(roles)} hosts do not fit one /24")
        self.roles = list(roles)
        # interface names have 15 characters: tmx + pid (<= 7) + letter + v + index (<= 3)
        self.tag = f"{PREFIX}{os.getpid()}{_LETTERS[next(_labs) % len(_LETTERS)]}"
        self.bridge = f"{self.tag}br"
        self.subnet: ipaddress.IPv4Network | None = None
        self.root_address = ""
        self.hosts: dict[str, NsHost] = {}
        self._namespaces: list[str] = []
        self._links: list[str] = []

    def host(self, role: str) -> NsHost:
        try:
            return self.hosts[role]
        except KeyError:
            raise ConfigError(f"no host {role!r} in this lab (have {sorted(self.hosts)})") from None

    async def _start(self) -> None:
        await require_netns()
        await cleanup_stale()
        self.subnet = await self._free_subnet()
        hosts = list(self.subnet.hosts())
        self.root_address = str(hosts[0])
        await _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        await _run("ip", "addr", "add", f"{self.root_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        await _run("ip", "link", "set", self.bridge, "up")
        for i, role in enumerate(self.roles):
            self.hosts[role] = await self._add_host(role, i, str(hosts[i + 1]))
        for h in self.hosts.values():
            await self.check_route(h.address)
        log.info("netns lab %s up: bridge %s %s, %d hosts", self.tag, self.bridge, self.subnet, len(self.hosts),
                 extra=kv(event="netns_up"))

    async def _add_host(self, role: str, i: int, address: str) -> NsHost:
        assert self.subnet is not None
        ns = f"{self.tag}-{role}"
        veth, peer = f"{self.tag}v{i}", f"{self.tag}p{i}"
        await _run("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        await _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        self._links.append(veth)  # deleting one end removes the pair
        await _run("ip", "link", "set", peer, "netns", ns)
        await _run("ip", "-n", ns, "link", "set", peer, "name", "eth0")
        await _run("ip", "-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        await _run("ip", "-n", ns, "link", "set", "eth0", "up")
        await _run("ip", "-n", ns, "link", "set", "lo", "up")
        await _run("ip", "link", "set", veth, "master", self.bridge)
        await _run("ip", "link", "set", veth, "up")
        return NsHost(role=role, netns=ns, address=address, veth=veth)

    async def _stop(self) -> None:
        for ns in reversed(self._namespaces):
            for pid in (await _run("ip", "netns", "pids", ns, check=False)).split():
                # only what we started lives here; a survivor would keep the namespace alive
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            await _run("ip", "netns", "del", ns, check=False)
        for link in reversed(self._links):
            await _run("ip", "link", "del", link, check=False)
        self._namespaces.clear()
        self._links.clear()
        log.info("netns lab %s removed", self.tag, extra=kv(event="netns_down"))

    async def _free_subnet(self) -> ipaddress.IPv4Network:
        used: list[ipaddress.IPv4Network] = []
        for cmd in (("ip", "-4", "route", "show", "table", "all"), ("ip", "-4", "-o", "addr", "show")):
            for word in (await _run(*cmd)).split():
                with contextlib.suppress(ValueError):
                    used.append(ipaddress.ip_network(word, strict=False))  # type: ignore[arg-type]
        for net in POOL.subnets(new_prefix=24):
            assert isinstance(net, ipaddress.IPv4Network)
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                return net
        raise MeshError(f"no free /24 left in {POOL} on this machine")

    async def check_route(self, address: str) -> None:
        """Refuse unless ``ip route get address`` leaves by this lab's bridge: a root-namespace client
        aimed elsewhere could send packets out of the machine by the default route."""
        out = await _run("ip", "-o", "route", "get", address)
        if f" dev {self.bridge} " not in f" {out} ":
            raise MeshError(f"{address} is not reached through the lab bridge {self.bridge}: {out.strip()}")

    async def block(self, role: str, *, peer: str, port: int | None, kind: DrillKind) -> None:
        """In ``role``'s namespace, stop TCP traffic with ``peer`` (on ``port`` of the peer, when given)
        in both directions: ``cut`` resets it, ``blackhole`` drops it silently."""
        ns = self.host(role).netns
        out_match = ["-p", "tcp", "-d", peer] + (["--dport", str(port)] if port else [])
        in_match = ["-p", "tcp", "-s", peer] + (["--sport", str(port)] if port else [])
        action = ["-j", "DROP"] if kind == "blackhole" else ["-j", "REJECT", "--reject-with", "tcp-reset"]
        if kind == "cut":  # let the resets through: the OUTPUT rule's own reset arrives from the peer
            in_match += ["!", "--tcp-flags", "RST", "RST"]
        for chain, match in (("OUTPUT", out_match), ("INPUT", in_match)):
            await _run("ip", "netns", "exec", ns, "iptables", "-w", "5", "-I", chain, *match, *action)
        log.warning("%s: %s traffic with %s%s", role, kind, peer, f":{port}" if port else "",
                    extra=kv(event=f"link_{kind}", site=role))

    async def unblock(self, role: str) -> None:
        """Remove every drill rule in ``role``'s namespace."""
        await _run("ip", "netns", "exec", self.host(role).netns, "iptables", "-w", "5", "-F")
