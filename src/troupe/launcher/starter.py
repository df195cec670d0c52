"""Starting this node's ranks: forked from the launcher's zygote where it can be, else a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from troupe.launcher.plan import LaunchPlan
from troupe.launcher.ports import Ports
from troupe.runtime.rankio import RankOutput
from troupe.runtime.ticket import Ticket


class Starter:
    """Starts this node's ranks with the job's environment (and, under --elastic, warm spares)."""

    def __init__(self, plan: LaunchPlan, ticket: Ticket, ports: Ports, output: RankOutput | None,
                 extra_env: dict[str, str] | None = None):
        self.plan, self.ticket, self.output = plan, ticket, output
        self.extra_env = {**plan.env, **(extra_env or {})}
        self.master_port = ports.torch_port(ticket, plan.place)
        self.started: set[int] = set()
        """The pids of every process this launcher started (ranks, spares): the orphans it inherits are the rest."""
        self._reaped_at = 0.0

    def reap_orphans(self) -> None:
        """At most every 2 s: reap the exited orphans the launcher inherits as its forked ranks' subreaper."""
        from troupe.runtime import zygote

        now = time.monotonic()
        house = zygote.current()
        if house is None or now - self._reaped_at < 2.0:
            return
        self._reaped_at = now
        zygote.reap_orphans(self.started | {house.proc.pid})

    def env(self, rank: int | None, **more: str) -> dict[str, str]:
        """The environment of rank `rank` (None: what every rank shares, a spare's)."""
        plan = self.plan
        env = {**os.environ, **self.extra_env, **more}
        env.update(
            TROUPE_TICKET=self.ticket.encode(),
            WORLD_SIZE=str(plan.world_size),
            LOCAL_WORLD_SIZE=str(plan.nproc),
            MASTER_ADDR=self.ticket.addr,
            MASTER_PORT=str(self.master_port),
        )
        if rank is not None:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank - plan.place.ranks.start))
        # c10d logs a lost store connection as a warning with pages of C++ frames on every survivor of
        # a stopped job; troupe's watchdog says who died in one line (set the variable to see them).
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        if self.output is not None and sys.stdout.isatty():
            env.setdefault("PYTHONUNBUFFERED", "1")  # a pipe would hold the lines a terminal shows at once
        return env

    def __call__(self, rank: int, restart: bool = False, **more: str) -> subprocess.Popen:
        """Rank `rank`, forked from this launcher's zygote where it can be (runtime/zygote.py), else afresh."""
        server = rank in self.plan.servers.ranks
        argv = ["troupe.cluster.bootstrap"] if server else list(self.plan.argv)
        env = self.env(rank, **more)
        proc = self._fork(argv, env, module=server, restart=restart)
        if proc is None:
            proc = self._popen([sys.executable, *(["-m"] if server else []), *argv], env)
        return self._attach(rank, proc)

    @property
    def forks(self) -> bool:
        """Whether this launcher's ranks were forked from a zygote (then restarts need no warm spares)."""
        from troupe.runtime import zygote

        return zygote.current() is not None

    def _zygote(self):
        from troupe.runtime import zygote

        env = self.env(None)
        if "torch" in sys.modules and self.plan.mode == "fixed":
            # A launcher forked by a `troupe fork-server` (runtime/forkserver.py) has torch: its zygote is forked
            # from it (one started afresh where it cannot be). Only here, at its first rank, where no `finally`
            # of the launcher's lies between this frame and `main` (a rank leaves through them: `RunRank`); an
            # elastic launcher forks in `load_torch`, before its own.
            zygote.fork_shared(env)
        return zygote.shared(env, say=lambda line: print(line, file=sys.stderr, flush=True))

    def _fork(self, argv: list[str], env: dict[str, str], module: bool, restart: bool):
        from troupe.runtime import zygote
        from troupe.runtime.spare import WARM_VAR

        house = self._zygote()
        if house is None:
            return None
        if restart:
            env = {**env, WARM_VAR: "1"}  # a restart that did not start Python anew
        pipes = [os.pipe(), os.pipe()] if self.output is not None else None
        try:
            proc = house.spawn(argv, env, module=module, stdout=pipes and pipes[0][1], stderr=pipes and pipes[1][1])
        except OSError as e:
            print(f"troupe run: ranks start afresh from now on (the zygote failed: {e})", file=sys.stderr, flush=True)
            zygote.forget(house)
            for r, _ in pipes or ():
                os.close(r)
            return None
        finally:
            for _, w in pipes or ():
                os.close(w)
        if pipes:
            proc.stdout, proc.stderr = os.fdopen(pipes[0][0], "rb"), os.fdopen(pipes[1][0], "rb")
        return proc

    def spare(self) -> subprocess.Popen:
        """A process that imports torch now and runs the script as the rank it is handed later."""
        cmd = [sys.executable, "-m", "troupe.runtime.spare", *self.plan.argv]
        proc = self._popen(cmd, self.env(None), stdin=subprocess.PIPE)
        self.started.add(proc.pid)
        return proc

    def from_spare(self, spares, rank: int, **more: str) -> subprocess.Popen:
        """Rank `rank` started in a waiting spare (then a new spare starts), else afresh."""
        proc = spares.take(self.env(rank, **more))
        if proc is None:
            return self(rank, restart=True, **more)
        spares.fill()
        return self._attach(rank, proc)

    def _popen(self, cmd: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        from troupe.runtime.zygote import rank_leader

        pipes = self.output.pipes() if self.output is not None else {}
        leader = rank_leader("stdin" not in kwargs and os.isatty(0))  # a rank given stdin gets a pipe
        return subprocess.Popen(cmd, env=env, **leader, **pipes, **kwargs)

    def _attach(self, rank: int, proc: subprocess.Popen) -> subprocess.Popen:
        self.started.add(proc.pid)
        if self.output is not None:
            self.output.attach(rank, proc)
        return proc
