"""mpiexec with a hostfile across two simulated hosts (network namespaces, troupe.bench.netns).

mpiexec runs inside host 0 as it would on a cluster's first node and starts its daemon on
host 1 through `scripts/netns_rsh.sh` where it would use ssh; Open MPI's own traffic stays
on the hosts' switch (10.78.0.0/24). Nothing tells troupe where rank 0 listens or which
interface Gloo binds to: the hostnames resolve to nothing, so troupe finds the address that
routes to the other host by itself. Every rank must end with the single-process reference's
parameters. Needs root, iproute2, unshare, mpiexec and mpi4py; skipped with the reason elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from troupe.bench import netns

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]
SLOTS = ([1, 1], [2, 1])
"""Ranks per host in each run: one rank per host, then two ranks sharing host 0 (local ranks 0 and 1)."""
SUBNET = "10.78.0.0/24"
"""Hosts' switch: Open MPI's out-of-band and TCP transport stay on it (not the machine's own interfaces)."""


def _missing() -> str | None:
    why = netns.available()
    if why:
        return f"simulated hosts: {why}"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux): each simulated host gets its own hostname"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not installed (pip install 'torch-troupe[mpi]')"
    if shutil.which("mpiexec") is None:
        return "mpiexec not on PATH (pip install 'torch-troupe[mpi]' installs Open MPI)"
    return None


pytestmark = [pytest.mark.netns, pytest.mark.mpi, pytest.mark.slow, pytest.mark.skipif(bool(_missing()), reason=str(_missing()))]


def mpiexec_on_hosts(hosts: netns.Hosts, slots: list[int], out: Path) -> subprocess.CompletedProcess:
    """`mpiexec --hostfile` from host 0 with `slots[i]` ranks on host i; each rank writes out/rank{R}.pt."""
    hostfile = out / "hostfile"
    hostfile.write_text("".join(f"{name} slots={n}\n" for name, n in zip(hosts.names, slots)))
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "TROUPE_MASTER_ADDR")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               TROUPE_JOIN_TIMEOUT="30", TROUPE_TIMEOUT="60")
    mpiexec = [shutil.which("mpiexec"), "--hostfile", str(hostfile), "-n", str(sum(slots)),
               "--mca", "plm_ssh_agent", str(SCRIPTS / "netns_rsh.sh"), "--mca", "plm_ssh_no_tree_spawn", "1",
               "--mca", "oob_tcp_if_include", SUBNET, "--mca", "btl_tcp_if_include", SUBNET,
               "-x", "OMP_NUM_THREADS", "-x", "TROUPE_JOIN_TIMEOUT", "-x", "TROUPE_TIMEOUT",
               sys.executable, str(SCRIPTS / "hosts_train.py"), str(out)]
    # mpiexec on host 0 under host 0's own hostname, as on a cluster's first node
    cmd = ["ip", "netns", "exec", hosts.names[0], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
           hosts.names[0], *mpiexec]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        left = f"{_processes(hosts)}\n{hosts.stacks()}"
        hosts.kill_all()  # the daemon on host 1 is no child of ours
        raise AssertionError(f"{slots}: mpiexec did not finish within 120 s\n{e.stdout}\n{e.stderr}\n{left}") from None


def _processes(hosts: netns.Hosts) -> str:
    """What still runs inside each host (state, kernel wait channel, command), for a hang's report."""
    lines = []
    for i, ns in enumerate(hosts.names):
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            ps = subprocess.run(["ps", "-o", "pid=,stat=,wchan:24=,args=", "-p", pid], capture_output=True, text=True)
            lines.append(f"host {i}: {ps.stdout.strip()[:240]}")
    return "\n".join(lines)


@pytest.mark.timeout(1200)  # up to 15 min queued behind other simulated hosts (netns.LOCK), then about 30 s
def test_mpiexec_hostfile_on_two_hosts(tmp_path):
    spec = importlib.util.spec_from_file_location("hosts_train", SCRIPTS / "hosts_train.py")
    hosts_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hosts_train)
    with netns.Hosts(2) as hosts:
        for slots in SLOTS:
            out = tmp_path / "x".join(map(str, slots))
            out.mkdir()
            proc = mpiexec_on_hosts(hosts, slots, out)
            assert proc.returncode == 0, f"{slots}: mpiexec exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
            expected = hosts_train.reference(sum(slots))
            # ranks fill the hosts in hostfile order: rank r runs on host `on_host[r]`
            on_host = [i for i, n in enumerate(slots) for _ in range(n)]
            for rank, host in enumerate(on_host):
                s = torch.load(out / f"rank{rank}.pt")
                assert (s["launcher"], s["world_size"]) == ("mpi", sum(slots))
                assert s["hostname"] == hosts.names[host] and hosts.addr(host) in s["addresses"], (rank, s)
                assert (s["local_rank"], s["local_world_size"]) == (on_host[:rank].count(host), slots[host])
                assert s["gloo_ifname"] == f"th{host}"  # picked by troupe: the interface towards rank 0
                for got, want in zip(s["params"], expected):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
