"""What an elastic launcher's two kinds share: torch loaded, and ranks supervised and restarted alone."""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from troupe.launcher.processes import kill_now, stop_all
from troupe.launcher.plan import LaunchPlan
from troupe.launcher.starter import Starter
from troupe.runtime.rankio import RankOutput


def afresh_unless_quiet() -> None:
    """Another node's elastic launcher loads torch with c10's C++ logging at FATAL (`load_torch`). One forked
    by a `troupe fork-server` has torch loaded with the server's level, which cannot change now: it starts
    itself afresh, the same process (its pid, descriptors and parent), before it has said anything."""
    from troupe.runtime import forkserver, zygote

    loaded = zygote.imported_with()
    if loaded is None or loaded["TORCH_CPP_LOG_LEVEL"] == os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    env = {name: value for name, value in os.environ.items() if name != forkserver.ENV_VAR}
    os.execve(sys.executable, [sys.executable, "-m", "troupe", *sys.argv[1:]], env)


def load_torch(plan: LaunchPlan, start: Starter, say: Callable[[str], None]) -> None:
    """An elastic launcher keeps (node 0) or reaches the job's store, so it imports torch itself.

    Node 0's does so with what the ranks share as its environment and forks its zygote from itself
    (`zygote.fork_shared`), before any thread of its own starts, instead of starting a second interpreter
    that imports torch again (1 CPU-s less at every such job's start here); its C++ logging is then the
    ranks' (ERROR unless set), which hides c10d's warnings as FATAL does. Another node's launcher loads
    torch with c10's C++ logging at FATAL: c10d warns on every connection where the hostname does not
    resolve (a host without DNS for itself) and logs a page of C++ frames when node 0's store does not
    answer (one line says so here); its ranks get the environment as it was."""
    node_rank = plan.place.node_rank
    if node_rank == 0 or "torch" in sys.modules:  # (another node's, forked by a `troupe fork-server`)
        from troupe.runtime import zygote

        zygote.fork_shared(start.env(None), say=say if node_rank == 0 else None)
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    importlib.import_module("torch")
    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def early_failure(house, output: RankOutput | None) -> Callable[[int, int, subprocess.Popen], str | None]:
    """How a life of a rank failed (its last line of stderr) when it never asked to join the quorum."""

    def early(rank: int, life: int, proc: subprocess.Popen) -> str | None:
        if output is None or house.asked(rank, life):
            return None
        # without torch's "[rankN]: " in front (its excepthook's), which differs from rank to rank
        return re.sub(r"^\[rank\d+\]:\s*", "", output.last_error_line(proc)) or None

    return early


def supervise_restarting(plan: LaunchPlan, start: Starter, house, spare_count: int, ranks: list[int],
                          say: Callable[[str], None], also_poll: Callable[[], None] = lambda: None, **more) -> int:
    """Supervise `ranks` under --elastic (launcher/supervisor.py): a restart runs in a warm spare once `house`
    (the lighthouse, or elastic parameter servers' keeper) says the job has formed; SIGTERM and Ctrl-C
    stop every rank (130); `also_poll()` runs at each look (it may raise `EndedElsewhere`, which stops
    every rank too and is raised again here). `more`: the rest of `supervise`'s settings."""
    from troupe.launcher.supervisor import supervise
    from troupe.runtime.spare import Spares

    spares = None

    def spawn(rank: int, incarnation: int) -> subprocess.Popen:
        if incarnation == 0 or spares is None:  # the job's start, or no spares: forked or afresh
            return start(rank, restart=incarnation > 0, TROUPE_INCARNATION=str(incarnation))
        return start.from_spare(spares, rank, TROUPE_INCARNATION=str(incarnation))

    def start_spares() -> None:
        nonlocal spares
        # Forked ranks start in milliseconds: spares only where ranks start afresh (TROUPE_FORK=0, not Linux).
        if spares is None and spare_count and house.formed_once and not start.forks:
            spares = Spares(spare_count, start.spare)
        start.reap_orphans()
        also_poll()

    def terminated(*_sig):
        raise KeyboardInterrupt  # the supervisor stops every worker

    old = signal.signal(signal.SIGTERM, terminated)
    try:
        return supervise(spawn, ranks, house, restarts_per_rank=plan.elastic.restarts_per_rank, say=say,
                         stop_all=stop_all, every_poll=start_spares, kill=kill_now, **more)
    except EndedElsewhere:
        raise
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
        if spares is not None:
            spares.stop()
        if start.output is not None:
            start.output.drain()


class EndedElsewhere(KeyboardInterrupt):
    """Another node's launcher stopped the job (its exit code): the supervisor stops this node's ranks."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def keep_store_until_done(lighthouse, options) -> None:
    """Node 0's ranks are done; the other nodes' may still be voting on their last step or saying
    goodbye through this launcher's store: keep it up until every rank has finished or is gone."""
    deadline = time.monotonic() + options.timeout + options.evict_after
    while not lighthouse.done() and time.monotonic() < deadline:
        time.sleep(0.05)
