"""A fixed job's processes: start this node's ranks, watch them, stop them all when one fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from troupe.launcher.plan import LaunchPlan
from troupe.launcher.ports import Ports
from troupe.launcher.starter import Starter
from troupe.runtime.rankio import RankOutput
from troupe.runtime.zygote import ZygoteSlot

GRACE_SECONDS = 5.0
"""How long a rank gets to exit after SIGTERM before SIGKILL."""
SETTLE_SECONDS = 1.0
"""After a rank exits with an error code, how long to look for a rank killed by a signal before
naming one: the killed rank is the cause, and on a loaded machine its peers' reactions ("my peer
is gone", code 1) can be collected first, since a killed process's sockets close before its
exit status can be collected."""


def run_once(plan: LaunchPlan, output: RankOutput | None, ports: Ports, extra_env: dict[str, str],
             zygotes: ZygoteSlot | None = None) -> int:
    """Start this node's ranks, watch them, and stop them all as soon as one fails."""
    ticket = ports.ticket(plan.place)  # a fresh port and token for every attempt
    start = Starter(plan, ticket, ports, output, extra_env, ZygoteSlot() if zygotes is None else zygotes)
    start.zygote()  # first: a rank forked from a zygote this launcher forks leaves through no `finally` below
    procs: list[subprocess.Popen] = []
    # SIGTERM while the ranks start stops those started (`supervise_all` handles it from then on)
    old = signal.signal(signal.SIGTERM, lambda *_: (stop_all(procs), sys.exit(143)))
    try:
        for rank in plan.place.ranks:
            procs.append(start(rank))
    finally:
        signal.signal(signal.SIGTERM, old)
    drain = output.drain if output is not None else lambda: None
    try:
        return supervise_all(procs, first_rank=plan.place.ranks.start, tolerate=plan.servers.expendable, drain=drain)
    finally:
        drain()


def kill_now(proc: subprocess.Popen) -> None:
    """SIGKILL a rank's session (a worker group's partner of a dead rank: its replica is incomplete)."""
    signal_group(proc, signal.SIGKILL)
    proc.wait()


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every rank still running; SIGKILL those still there after GRACE_SECONDS."""
    for p in procs:
        if p.poll() is None:
            signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            signal_group(p, signal.SIGKILL)
            p.wait()


def culprit(procs: list[subprocess.Popen], first_rank: int, tolerate: set[int],
             failed: list[tuple[int, int]]) -> tuple[int, int]:
    """The failed rank to name: one killed by a signal if one appears within SETTLE_SECONDS, else the first."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while not any(code < 0 for _, code in failed) and time.monotonic() < deadline:
        time.sleep(0.05)
        failed = [(first_rank + i, c) for i, c in enumerate(p.poll() for p in procs)
                  if c not in (None, 0) and first_rank + i not in tolerate]
    return next(((rank, code) for rank, code in failed if code < 0), failed[0])


def supervise_all(procs: list[subprocess.Popen], first_rank: int, tolerate: set[int] = frozenset(),
                 drain=lambda: None) -> int:
    """Wait for the ranks; stop them all when one fails, unless it is in `tolerate` (async PS workers).

    `drain()` returns once the ranks' output has been passed on (before the closing line is printed).
    """
    reported: set[int] = set()

    def stop_these(*_sig) -> None:
        stop_all(procs)

    old = signal.signal(signal.SIGTERM, lambda *s: (stop_these(), sys.exit(143)))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(first_rank + i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            for rank, code in failed:
                if rank in tolerate and rank not in reported:
                    reported.add(rank)
                    print(f"troupe run: worker rank {rank} exited with code {code}; the asynchronous cluster "
                          "goes on without it", file=sys.stderr)
            failed = [(rank, code) for rank, code in failed if rank not in tolerate]
            if failed:
                rank, code = culprit(procs, first_rank, tolerate, failed)
                stop_these()
                drain()
                why = f"signal {-code}" if code < 0 else f"code {code}"
                print(f"troupe run: rank {rank} exited with {why}; stopped the other ranks", file=sys.stderr)
                return code if code > 0 else 128 - code
            if all(c == 0 or (c is not None and first_rank + i in tolerate) for i, c in enumerate(codes)):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        stop_these()
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
