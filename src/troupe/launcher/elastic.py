"""What an elastic launcher's two kinds share: torch loaded, and ranks supervised and restarted alone."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from troupe.launcher.processes import kill_now, stop_all
from troupe.launcher.plan import LaunchPlan
from troupe.launcher.policies import RestartPolicy
from troupe.launcher.starter import Starter
from troupe.runtime.zygote import ZygoteSlot


def afresh_unless_quiet(zygotes: ZygoteSlot) -> None:
    """Another node's elastic launcher loads torch with c10's C++ logging at FATAL (`load_torch`). One forked
    by a `troupe fork-server` has torch loaded with the server's level, which cannot change now: it starts
    itself afresh, the same process (its pid, descriptors and parent), before it has said anything."""
    from troupe.runtime import forkserver

    loaded = zygotes.loaded
    if loaded is None or loaded["TORCH_CPP_LOG_LEVEL"] == os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    env = {name: value for name, value in os.environ.items() if name != forkserver.ENV_VAR}
    os.execve(sys.executable, [sys.executable, "-m", "troupe", *sys.argv[1:]], env)


def load_torch(plan: LaunchPlan, start: Starter, say: Callable[[str], None]) -> None:
    """An elastic launcher keeps (node 0) or reaches the job's store, so it imports torch itself.

    Node 0's does so with what the ranks share as its environment and forks its zygote from itself
    (`ZygoteSlot.fork_shared`), before any thread of its own starts, instead of starting a second interpreter
    that imports torch again (1 CPU-s less at every such job's start here); its C++ logging is then the
    ranks' (ERROR unless set), which hides c10d's warnings as FATAL does. Another node's launcher loads
    torch with c10's C++ logging at FATAL: c10d warns on every connection where the hostname does not
    resolve (a host without DNS for itself) and logs a page of C++ frames when node 0's store does not
    answer (one line says so here); its ranks get the environment as it was."""
    node_rank = plan.place.node_rank
    if node_rank == 0 or "torch" in sys.modules:  # (another node's, forked by a `troupe fork-server`)
        start.zygotes.fork_shared(start.env(None), say=say if node_rank == 0 else None)
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    importlib.import_module("torch")
    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


class ElasticProcesses:
    """The supervisor's `Processes` under --elastic: ranks started by `start` (a restart in a warm spare
    once `house` says the job has formed, where ranks start afresh), killed by session."""

    def __init__(self, start: Starter, house, spare_count: int, others: OtherNodes | StoreWatch | None = None):
        self.starter, self.house, self.spare_count, self.others = start, house, spare_count, others

    def start(self, rank: int, incarnation: int) -> subprocess.Popen:
        return self.starter(rank, incarnation=incarnation)

    def kill(self, proc: subprocess.Popen) -> None:
        kill_now(proc)

    def stop_all(self, procs: list[subprocess.Popen]) -> None:
        stop_all(procs)

    def poll(self) -> None:
        # Forked ranks start in milliseconds: spares only where ranks start afresh (TROUPE_FORK=0, not Linux).
        # They start once the job has formed, not before: their imports would slow the ranks' start.
        if self.house.formed_once and not self.starter.forks:
            self.starter.keep_spares(self.spare_count)
        self.starter.reap_orphans()
        if self.others is not None:
            self.others.check()


def supervise_restarting(plan: LaunchPlan, processes: ElasticProcesses, house, policy: RestartPolicy,
                         say: Callable[[str], None], **rules) -> int:
    """Supervise this node's ranks under --elastic (launcher/supervisor.py); SIGTERM and Ctrl-C stop every
    rank (130); another node's end (`EndedElsewhere`, from `processes.poll`) stops them too and is raised
    again here. `rules`: the rest of the supervisor's `Rules`."""
    from troupe.launcher.supervisor import Rules, Supervisor

    assert plan.elastic is not None

    def terminated(*_sig):
        raise KeyboardInterrupt  # the supervisor stops every worker

    old = signal.signal(signal.SIGTERM, terminated)
    start = processes.starter
    try:
        return Supervisor(list(plan.place.ranks), processes, house, policy,
                          Rules(restarts_per_rank=plan.elastic.restarts_per_rank, **rules), say).run()
    except EndedElsewhere:
        raise
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
        start.stop()
        if start.output is not None:
            start.output.drain()


STORE_SILENCE_SECONDS = 15.0
"""Another node's elastic launcher ends the job on its node once node 0's store (in node 0's launcher) has not
answered for this long: node 0's launcher is gone, and with it the quorum (or the servers' keeper) that every
step and restart needs. A store on a loaded host still answers within a second or two (it serves from a
thread of its own); 15 s is the default step timeout plus eviction bound (`ElasticOptions`)."""

PING_SECONDS = 1.0
"""How often `StoreWatch` asks node 0's store, and how long one try may take."""


class StoreWatch:
    """Another node's launcher: whether node 0's launcher, which hosts the job's store, still answers.

    A daemon thread asks the store a cheap question every `PING_SECONDS` on a connection of its own with a
    short timeout (the launcher's own connection waits as long as a join may, and the supervisor's loop must
    not wait at all); `check`, from the supervisor's loop, ends this node's part of the job once the store
    has been silent for `silence` seconds. Without it another node's ranks, whose votes fail, would restart
    again and again, each waiting out its join timeout, for as long as the restart budget lasts."""

    def __init__(self, ticket, say: Callable[[str], None], silence: float = STORE_SILENCE_SECONDS):
        self.ticket, self.say, self.silence = ticket, say, silence
        self.answered = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ping, name="troupe-store-watch", daemon=True)
        self._thread.start()

    def _ping(self) -> None:
        from troupe.runtime.launch import open_store

        store = None
        while not self._stop.wait(PING_SECONDS):
            try:
                if store is None:
                    store = open_store(self.ticket, False, PING_SECONDS)
                store.check(["troupe/digest"])
                self.answered = time.monotonic()
            except (RuntimeError, ConnectionError, OSError):
                store = None  # connect afresh next time: node 0's launcher may be back at the same address

    def check(self) -> None:
        """Raise `EndedElsewhere` (code 1) once node 0's store has been silent for `silence` seconds."""
        silent = time.monotonic() - self.answered
        if silent > self.silence:
            self.say(f"troupe run: node 0's launcher (the job's store at {self.ticket.addr}:{self.ticket.port}) has "
                     f"not answered for {silent:.0f} s: the job cannot go on without it; stopping this node's ranks")
            raise EndedElsewhere(1)

    def stop(self) -> None:
        """Stop asking, and wait for a question in flight (at most `PING_SECONDS` to connect, as long to
        answer): a thread still inside torch's store client when the interpreter exits aborts the process."""
        self._stop.set()
        self._thread.join(timeout=3 * PING_SECONDS + 1.0)


class OtherNodes:
    """Elastic parameter servers on several nodes: each node's launcher beats through the keeper and
    learns there when another node stopped the job (a server died there); another node's also watches
    node 0's store (`StoreWatch`)."""

    def __init__(self, keeper, node_rank: int, say: Callable[[str], None], watch: StoreWatch | None = None):
        self.keeper, self.node_rank, self.say, self.watch = keeper, node_rank, say, watch

    def check(self) -> None:
        """Raise `EndedElsewhere` once another node stopped the job, or node 0's launcher is gone: this
        node's ranks stop too."""
        if self.watch is not None:
            self.watch.check()
        self.keeper.beat(self.node_rank)
        code = self.keeper.ended()
        if code is not None:
            self.say(f"troupe run: another node stopped the job (code {code}); stopping this node's ranks")
            raise EndedElsewhere(code)


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
