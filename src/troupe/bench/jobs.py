"""Run one whole training job under `troupe run`, on loopback or on simulated hosts: the job suites' runner.

    job = run_job(["benchmarks/throughput_job.py", "--steps", "30"], 2)                  # troupe run -n 2
    job = run_job(["benchmarks/throughput_job.py", "--steps", "30"], 2, link="100mbit")  # 2 simulated hosts
    job.check()              # RuntimeError with the tails of stderr when a process failed
    job.stdout               # the first process's output (rank 0's)

On loopback the job is one `troupe run -n N --threads T FLAGS SCRIPT ...`. With a `link`
("none" for an unshaped one, or a tc rate such as "1gbit") every process gets its own network
namespace on one bridge (`troupe.bench.netns`) and runs `troupe run -n 1 --nnodes N
--node-rank i --master HOST0:PORT --token T`; what each host's interface transmitted and
its TCP retransmissions are counted. Every process is killed at `timeout`; namespaces are
removed afterwards.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from troupe.bench.records import checkout_root


@dataclass(frozen=True)
class Job:
    """What the processes of one job printed and how they ended (one entry per process)."""

    outs: list[str]
    errs: list[str]
    codes: list[int]
    tx_bytes: list[int] = field(default_factory=list)
    """Per simulated host: bytes its interface transmitted during the job (empty on loopback)."""
    retransmits: list[int] = field(default_factory=list)
    """Per simulated host: TCP segments sent again (bytes on the wire that no counter sees)."""

    @property
    def stdout(self) -> str:
        return self.outs[0]

    @property
    def stderr(self) -> str:
        return "\n".join(self.errs)

    @property
    def failed(self) -> bool:
        return any(self.codes)

    def check(self, tail: int = 3000) -> Job:
        """This job, or RuntimeError with the end of every failed process's stderr."""
        if self.failed:
            raise RuntimeError(f"the job failed (exit codes {self.codes}):\n"
                               + "\n".join(err[-tail:] for err, code in zip(self.errs, self.codes) if code))
        return self


def run_job(script: Sequence[str], nprocs: int | None, *, flags: Sequence[str] = (), link: str | None = None,
            delay: str | None = None, threads: int | None = 1, env: dict[str, str] | None = None,
            timeout: float = 3600.0) -> Job:
    """Run `script` (a path relative to the checkout, then its arguments) as one job of `nprocs` processes.

    Args:
        nprocs: processes (``-n``); None: `flags` say how many (a cluster's ``--nworker-groups`` ...).
        flags: more `troupe run` flags (``--framework downpour``, ``--wire-dtype fp16``).
        link: None for loopback; "none" or a tc rate ("100mbit") for one simulated host per process.
        delay: added one-way latency on the simulated links ("1ms").
        threads: ``--threads`` (and OMP_NUM_THREADS); None: troupe run's default.
        env: more variables for the processes (on top of this process's environment).
    """
    threads_env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    env = {**os.environ, **threads_env, **(env or {})}
    launcher = [sys.executable, "-m", "troupe.cli", "run", *(["--threads", str(threads)] if threads else [])]
    if link is None:
        cmd = [*launcher, *(["-n", str(nprocs)] if nprocs is not None else []), *flags, *script]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=checkout_root(), env=env)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{' '.join(cmd)} did not finish within {timeout:g} s") from None
        return Job([done.stdout], [done.stderr], [done.returncode])
    if nprocs is None:
        raise ValueError("a job on simulated hosts needs nprocs (one host per process)")
    return _on_hosts(script, nprocs, [*launcher, "-n", "1"], flags, link, delay, env, timeout)


def _on_hosts(script: Sequence[str], nprocs: int, launcher: list[str], flags: Sequence[str], link: str,
              delay: str | None, env: dict[str, str], timeout: float) -> Job:
    from troupe.bench.netns import Hosts

    token, port = secrets.token_hex(8), 29700 + secrets.randbelow(200)
    with Hosts(nprocs, rate=None if link == "none" else link, delay=delay) as hosts:
        before = [hosts.tx_bytes(i) for i in range(nprocs)]
        procs = []
        for i in range(nprocs):
            cmd = [*launcher, "--nnodes", str(nprocs), "--node-rank", str(i), "--master", f"{hosts.addr(0)}:{port}",
                   "--token", token, *flags, *script]
            procs.append(hosts.popen(i, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=checkout_root()))
        try:
            outs = [p.communicate(timeout=timeout) for p in procs]
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"a job on {nprocs} simulated hosts did not finish within {timeout:g} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        tx = [hosts.tx_bytes(i) - before[i] for i in range(nprocs)]
        retransmits = [hosts.retransmitted_segments(i) for i in range(nprocs)]
    return Job([o for o, _ in outs], [e for _, e in outs], [p.returncode for p in procs], tx, retransmits)
