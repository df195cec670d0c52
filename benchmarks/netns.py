"""Simulated hosts: N network namespaces on one bridge, each link shaped with tc.

    with Hosts(4, rate="100mbit", delay="1ms") as hosts:
        hosts.run(i, ["troupe", "run", ...])     # a command inside host i
        hosts.tx_bytes(i)                         # what host i's interface sent

Needs root (ip netns, ip link, tc). Only the 10.78.0.0/24 addresses inside the namespaces
made here are used; the bridge lives in its own namespace, and everything is removed on
exit (also after an error).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess

PREFIX = "troupe-h"
SWITCH = "troupe-sw"
LOCK = "/run/troupe-netns.lock"
"""One set of simulated hosts exists at a time on a machine: `Hosts` holds this file locked (flock)
from before it makes its namespaces until it has removed them, so parallel tests and benchmarks
queue instead of deleting each other's namespaces."""


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    name = f"troupe-probe-{os.getpid()}"  # this process's own: probes may run in parallel
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Hosts:
    """`n` namespaces "troupe-h0".."troupe-h{n-1}" with addresses 10.78.0.1.., joined by a bridge."""

    def __init__(self, n: int, rate: str | None = None, delay: str | None = None):
        self.n, self.rate, self.delay = n, rate, delay
        self.names = [f"{PREFIX}{i}" for i in range(n)]

    def addr(self, i: int) -> str:
        return f"10.78.0.{i + 1}"

    def __enter__(self) -> Hosts:
        self._lock = open(LOCK, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # wait for any other set of hosts to be removed
        self.cleanup()
        try:
            _sh("ip", "netns", "add", SWITCH)
            _sh("ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", SWITCH, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "link", "add", f"th{i}", "netns", ns, "type", "veth", "peer", "name", f"ts{i}",
                    "netns", SWITCH)
                _sh("ip", "-n", SWITCH, "link", "set", f"ts{i}", "master", "br0", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", f"th{i}")
                _sh("ip", "-n", ns, "link", "set", f"th{i}", "up")
                self._shape(ns, f"th{i}")
                self._shape(SWITCH, f"ts{i}")  # both directions of each host's link
        except BaseException:
            self.__exit__()
            raise
        return self

    def _shape(self, ns: str, dev: str) -> None:
        if self.delay and self.rate:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                "delay", self.delay)
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", "tbf",
                "rate", self.rate, "burst", "256kb", "latency", "200ms")
        elif self.rate:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                "burst", "256kb", "latency", "200ms")
        elif self.delay:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", self.delay)

    def __exit__(self, *exc) -> None:
        try:
            self.cleanup()
        finally:
            self._lock.close()  # releases the flock

    def cleanup(self) -> None:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(PREFIX) or name == SWITCH:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def popen(self, i: int, cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start `cmd` inside host i (Gloo bound to the host's interface)."""
        env = {**(env or os.environ), "GLOO_SOCKET_IFNAME": f"th{i}"}
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], env=env, **kw)

    def tx_bytes(self, i: int) -> int:
        out = subprocess.run(["ip", "netns", "exec", self.names[i], "cat", f"/sys/class/net/th{i}/statistics/tx_bytes"],
                             capture_output=True, text=True, check=True).stdout
        return int(out)
