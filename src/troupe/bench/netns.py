"""Simulated hosts: N network namespaces on one switch, each link shaped with tc, and faults.

    with Hosts(4, rate="100mbit", delay="1ms") as hosts:
        hosts.popen(i, ["troupe", "run", ...])   # a command inside host i
        hosts.tx_bytes(i)                         # what host i's interface sent
        hosts.lose(1, 10)                         # 10% packet loss on host 1's link, both ways
        hosts.slow(3, "1mbit")                    # host 3's link 100x slower
        hosts.add_delay(0, 200, jitter_ms=50)     # +200 ms on host 0's link (netem, or an NFQUEUE)
        hosts.link(2, up=False)                   # host 2's cable pulled at the switch
        hosts.partition([0, 1], [2, 3])           # two halves that cannot reach each other
        hosts.heal()                              # every link as it was built

Needs root (ip netns, ip link, tc; iptables for loss and, without netem, delay). Only the
10.78.0.0/24 addresses inside the namespaces made here are used; the switch (a bridge per
side of a partition) lives in its own namespace, and everything is removed on exit, also
after an error or Ctrl-C.

Every link is a veth pair: ``th{i}`` in host i, ``ts{i}`` in the switch; a rate is a tbf on
both ends, a base delay a netem above it. Loss is iptables' statistic match in the host's
namespace, not netem's: kernels without sch_netem (this project's build machines) have it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "troupe-h"
SWITCH = "troupe-sw"
LOCK = "/run/troupe-netns.lock"
"""One set of simulated hosts exists at a time on a machine: `Hosts` holds this file locked (flock)
from before it makes its namespaces until it has removed them, so parallel tests and benchmarks
queue instead of deleting each other's namespaces."""
BRIDGES = ("br0", "br1")
"""The switch's bridges: every port starts on br0; `partition` moves the second side to br1."""


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


def leftover() -> list[str]:
    """Simulated hosts of ours that exist while no `Hosts` holds the lock: after a run, a leak.

    Waits for the lock, so hosts another test or benchmark holds right now are never counted."""
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX) or n == SWITCH]


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


class Hosts:
    """`n` namespaces "troupe-h0".."troupe-h{n-1}" with addresses 10.78.0.1.., joined by a switch."""

    def __init__(self, n: int, rate: str | None = None, delay: str | None = None):
        self.n, self.rate, self.delay = n, rate, delay
        self.names = [f"{PREFIX}{i}" for i in range(n)]
        self._rates: list[str | None] = [rate] * n
        self._down: set[int] = set()
        self._delayed: dict[int, tuple[subprocess.Popen, float] | None] = {}
        """Hosts with injected delay: None (netem), or the delayer process and its longest delay (ms)."""

    def addr(self, i: int) -> str:
        return f"10.78.0.{i + 1}"

    def __enter__(self) -> Hosts:
        self._lock = open(LOCK, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # wait for any other set of hosts to be removed
        self.cleanup()
        try:
            _sh("ip", "netns", "add", SWITCH)
            for br in BRIDGES:
                _sh("ip", "-n", SWITCH, "link", "add", br, "type", "bridge")
                _sh("ip", "-n", SWITCH, "link", "set", br, "up")
            for i, ns in enumerate(self.names):
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "link", "add", f"th{i}", "netns", ns, "type", "veth", "peer", "name", f"ts{i}",
                    "netns", SWITCH)
                _sh("ip", "-n", SWITCH, "link", "set", f"ts{i}", "master", "br0", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", f"th{i}")
                _sh("ip", "-n", ns, "link", "set", f"th{i}", "up")
                for where, dev in self._ends(i):  # both directions of each host's link
                    self._shape(where, dev, "add", self.rate)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _shape(self, where: str, dev: str, verb: str, rate: str | None) -> None:
        """netem (the base delay) at the root with tbf (the rate) under it, or either alone."""
        tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "200ms"] if rate else []
        if self.delay:
            if verb == "add":
                _sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                    "delay", self.delay)
            if tbf:
                _sh("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "parent", "1:", "handle", "2:",
                    *tbf)
            elif verb != "add":
                subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "parent", "1:"],
                               capture_output=True)
        elif tbf:
            _sh("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root", *tbf)
        elif verb != "add":
            subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def __exit__(self, *exc) -> None:
        try:
            self.cleanup()
        finally:
            self._lock.close()  # releases the flock

    def cleanup(self) -> None:
        """Kill what still runs inside the hosts, then remove every namespace of ours."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(PREFIX) or name == SWITCH:
                _kill_inside(name)
                subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def stacks(self) -> str:
        """The Python stacks of every process inside the hosts (``py-spy dump``; "" without py-spy)."""
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
        if spy is None:
            return ""
        out = []
        for i, ns in enumerate(self.names):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                dump = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=30)
                out.append(f"=== host {i} pid {pid}\n{dump.stdout}{dump.stderr}")
        return "\n".join(out)

    def kill_all(self) -> int:
        """SIGKILL every process still running inside any host (a launcher's children included,
        whatever session they made); how many there were."""
        return sum(_kill_inside(ns) for ns in self.names)

    # --- running things ------------------------------------------------------------------

    def popen(self, i: int, cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start `cmd` inside host i (Gloo bound to the host's interface)."""
        env = {**(env or os.environ), "GLOO_SOCKET_IFNAME": f"th{i}"}
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], env=env, **kw)

    def retransmitted_segments(self, i: int) -> int:
        """TCP segments host i sent again (its namespace is fresh: since it was made)."""
        snmp = subprocess.run(["ip", "netns", "exec", self.names[i], "cat", "/proc/net/snmp"], capture_output=True,
                              text=True, check=True).stdout
        header, values = [line.split() for line in snmp.splitlines() if line.startswith("Tcp:")][:2]
        return int(values[header.index("RetransSegs")])

    def tx_bytes(self, i: int) -> int:
        out = subprocess.run(["ip", "netns", "exec", self.names[i], "cat", f"/sys/class/net/th{i}/statistics/tx_bytes"],
                             capture_output=True, text=True, check=True).stdout
        return int(out)

    # --- faults (each undone by heal) ------------------------------------------------------

    def lose(self, i: int, percent: float) -> None:
        """Drop `percent` of the packets host i sends and of those it receives (iptables'
        statistic match in the host's namespace; 0 stops dropping)."""
        self._check(i)
        if not 0 <= percent <= 100:
            raise ValueError(f"loss is a percentage in [0, 100], got {percent}")
        why = loss_available()
        if why:
            raise RuntimeError(f"cannot inject packet loss: {why}")
        ns, dev = self.names[i], f"th{i}"
        _sh("ip", "netns", "exec", ns, "iptables", "-F")
        if percent:
            p = f"{percent / 100:.6f}"
            for chain, way in (("INPUT", "-i"), ("OUTPUT", "-o")):
                _sh("ip", "netns", "exec", ns, "iptables", "-A", chain, way, dev, "-m", "statistic", "--mode",
                    "random", "--probability", p, "-j", "DROP")

    def slow(self, i: int, rate: str | None) -> None:
        """Host i's link (both ways) limited to `rate` ("1mbit"); None: back to the hosts' rate."""
        self._check(i)
        rate = rate or self.rate
        for where, dev in self._ends(i):
            self._shape(where, dev, "change", rate)
        self._rates[i] = rate

    def add_delay(self, i: int, ms: float, jitter_ms: float = 0.0) -> None:
        """Add `ms` (with `jitter_ms`, normally distributed) to host i's link, both ways: tc netem
        where the kernel has it, else an NFQUEUE and `troupe.bench.delayer` inside the host."""
        self._check(i)
        if netem_available() is None:
            base = _ms(self.delay) if self.delay else 0.0
            jitter = [f"{jitter_ms:g}ms", "distribution", "normal"] if jitter_ms else []
            for where, dev in self._ends(i):
                _sh("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:",
                    "netem", "delay", f"{base + ms:g}ms", *jitter)
                if self._rates[i]:
                    _sh("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "parent", "1:", "handle",
                        "2:", "tbf", "rate", self._rates[i], "burst", "256kb", "latency", "200ms")
            self._delayed[i] = None
            return
        why = delay_available()
        if why:
            raise RuntimeError(f"cannot inject delay: {why}")
        queue = 7 + i
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[i], sys.executable, "-m", "troupe.bench.delayer",
                                 "--queue", str(queue), "--ms", str(ms), "--jitter-ms", str(jitter_ms)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.stdout.readline().strip() != "delayer ready":
            proc.kill()
            raise RuntimeError(f"the packet delayer did not start in host {i}")
        self._delayed[i] = (proc, ms + 3 * jitter_ms)
        for chain, way in (("INPUT", "-i"), ("OUTPUT", "-o")):  # --queue-bypass: packets pass if it dies
            _sh("ip", "netns", "exec", self.names[i], "iptables", "-A", chain, way, f"th{i}", "-j", "NFQUEUE",
                "--queue-num", str(queue), "--queue-bypass")

    def link(self, i: int, *, up: bool) -> None:
        """Host i's cable at the switch: down (nothing passes either way, the host sees no carrier) or up."""
        self._check(i)
        _sh("ip", "-n", SWITCH, "link", "set", f"ts{i}", "up" if up else "down")
        (self._down.discard if up else self._down.add)(i)

    def partition(self, *sides: list[int]) -> None:
        """Split the switch in two: the hosts of `sides[1]` move to a second bridge, so the two
        sides cannot reach each other while each side's hosts still can."""
        if len(sides) != 2 or set(sides[0]) & set(sides[1]):
            raise ValueError(f"partition takes two disjoint lists of hosts, got {sides}")
        for i in (*sides[0], *sides[1]):
            self._check(i)
        for i in sides[1]:
            _sh("ip", "-n", SWITCH, "link", "set", f"ts{i}", "master", "br1")

    def heal(self) -> None:
        """Every link back to how it was built: on br0, up, no loss, the hosts' rate."""
        for i in range(self.n):
            _sh("ip", "-n", SWITCH, "link", "set", f"ts{i}", "master", "br0")
            if i in self._down:
                self.link(i, up=True)
            subprocess.run(["ip", "netns", "exec", self.names[i], "iptables", "-F"], capture_output=True)
            if i in self._delayed:
                delayer = self._delayed.pop(i)
                if delayer is None:  # netem: back to the built qdiscs
                    for where, dev in self._ends(i):
                        subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root"],
                                       capture_output=True)
                        self._rates[i] = self.rate
                        self._shape(where, dev, "add", self.rate)
                else:  # the iptables rules are gone (above): let the delayer release what it holds
                    proc, most_ms = delayer
                    time.sleep(most_ms / 1000)
                    proc.kill()
                    proc.wait()
            if self._rates[i] != self.rate:
                self.slow(i, None)

    # --- helpers -------------------------------------------------------------------------

    def _check(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise ValueError(f"host {i} does not exist (hosts 0..{self.n - 1})")

    def _ends(self, i: int) -> list[tuple[str, str]]:
        return [(self.names[i], f"th{i}"), (SWITCH, f"ts{i}")]


def _kill_inside(ns: str) -> int:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    return len(pids)


def loss_available() -> str | None:
    """None when `Hosts.lose` can drop packets here, else why not (it needs iptables with the statistic match)."""
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    try:
        with open("/proc/net/ip_tables_matches") as f:
            if "statistic" not in f.read().split():
                return "the kernel has no iptables statistic match"
    except OSError:
        return "the kernel has no iptables (no /proc/net/ip_tables_matches)"
    return None


def delay_available() -> str | None:
    """None when `Hosts.delay` can delay packets here (netem, or iptables' NFQUEUE), else why not."""
    if netem_available() is None:
        return None
    if shutil.which("iptables") is None:
        return "neither tc netem nor iptables (for an NFQUEUE) is available"
    try:
        with open("/proc/net/ip_tables_targets") as f:
            if "NFQUEUE" not in f.read().split():
                return "the kernel has neither sch_netem nor the iptables NFQUEUE target"
    except OSError:
        return "the kernel has neither sch_netem nor iptables"
    return None


def netem_available() -> str | None:
    """None when tc's netem (delay) works here, else why not."""
    name = f"troupe-probe-netem-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], capture_output=True)
    try:
        probe = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                "delay", "1ms"], capture_output=True, text=True)
        return None if probe.returncode == 0 else f"tc netem: {probe.stderr.strip()} (no sch_netem in this kernel)"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _ms(text: str) -> float:
    """"1ms", "0.5ms", "2s" -> milliseconds."""
    text = text.strip()
    for unit, scale in (("ms", 1.0), ("us", 1e-3), ("s", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)
