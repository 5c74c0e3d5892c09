"""A NetnsLab made for real: hosts reachable from each other and, through the bridge, from the root
namespace (proved with ``ip route get``, while an outside address is refused); ``cut`` resets,
``blackhole`` drops without a word; and nothing of the lab is left after it stops. Skipped with the
reason where namespaces cannot be made (not root, no ``ip``, no iptables)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from mesh.errors import MeshError
from tiermesh.netns import NetnsLab, unavailable_reason

REASON = unavailable_reason(firewall=True)
pytestmark = [pytest.mark.integration, pytest.mark.timeout(60),
              pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")]

PORT = 18099
PROBE = """
import socket, sys
s = socket.socket()
s.settimeout(1.5)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except TimeoutError:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as exc:
    print(f"error {exc.errno}")
"""


async def _probe(lab: NetnsLab, src: str, addr: str) -> str:
    proc = await asyncio.create_subprocess_exec(*lab.host(src).exec_prefix(), sys.executable, "-c", PROBE, addr,
                                                str(PORT), stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.decode().strip()


def _leftovers(tag: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    return [line for line in (ns + links).splitlines() if tag in line]


async def test_lab_routes_drills_and_cleanup() -> None:
    lab = NetnsLab(["a", "b", "c"])
    async with lab:
        hosts = {r: lab.host(r).address for r in ("a", "b", "c")}
        assert len(set(hosts.values())) == 3 and lab.root_address not in hosts.values()
        for addr in hosts.values():
            await lab.check_route(addr)  # via the bridge
        with pytest.raises(MeshError, match="not reached through the lab bridge"):
            await lab.check_route("192.0.2.77")  # TEST-NET-1: only asks the routing table
        server = await asyncio.create_subprocess_exec(
            *lab.host("b").exec_prefix(), sys.executable, "-m", "http.server", "--bind", hosts["b"], str(PORT),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            for _ in range(50):
                if await _probe(lab, "a", hosts["b"]) == "connected":
                    break
                await asyncio.sleep(0.1)
            assert await _probe(lab, "c", hosts["b"]) == "connected"
            await lab.block("a", peer=hosts["b"], port=PORT, kind="blackhole")
            assert await _probe(lab, "a", hosts["b"]) == "timeout"      # vanished: no reset
            assert await _probe(lab, "c", hosts["b"]) == "connected"    # only that link
            await lab.unblock("a")
            await lab.block("a", peer=hosts["b"], port=PORT, kind="cut")
            assert await _probe(lab, "a", hosts["b"]) == "refused"      # reset at once
            await lab.unblock("a")
            assert await _probe(lab, "a", hosts["b"]) == "connected"
        finally:
            server.terminate()
            await server.wait()
    assert _leftovers(lab.tag) == []


async def test_a_new_lab_removes_what_a_dead_run_left() -> None:
    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()  # a pid that no longer runs: the owner of the "stale" run
    ns, bridge = f"tmx{dead.pid}a-stale", f"tmx{dead.pid}abr"

    def sh(*cmd: str, check: bool = True) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, check=check).stdout

    await asyncio.to_thread(sh, "ip", "netns", "add", ns)
    try:
        await asyncio.to_thread(sh, "ip", "link", "add", bridge, "type", "bridge")
        async with NetnsLab(["x"]) as lab:
            assert _leftovers(f"tmx{dead.pid}a") == []
            assert lab.host("x").netns in await asyncio.to_thread(sh, "ip", "netns", "list")
    finally:
        await asyncio.to_thread(sh, "ip", "netns", "del", ns, check=False)
        await asyncio.to_thread(sh, "ip", "link", "del", bridge, check=False)
