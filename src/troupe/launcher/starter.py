"""Starting this node's ranks, each in the first way that can: a warm spare (a restart under --elastic),
a fork of the launcher's zygote (runtime/zygote.py), or a fresh interpreter.

    start = Starter(plan, ticket, ports, output)
    proc = start(rank)                  # a fixed job's rank
    proc = start(rank, incarnation=2)   # an elastic rank's third life (TROUPE_INCARNATION=2)

Each way is a `RankStart`: `start(command)` returns the process, or None when this way cannot start
it (no zygote, none waiting), and the next is tried. (`troupe fork-server` starts launchers, not
ranks: cli's `main` hands it the command line.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from troupe.launcher.plan import LaunchPlan
from troupe.launcher.ports import Ports
from troupe.runtime.rankio import RankOutput
from troupe.runtime.ticket import Ticket
from troupe.runtime.zygote import Zygote, ZygoteSlot


@dataclass(frozen=True, kw_only=True)
class RankCommand:
    """What one life of a rank runs: the script (a server: the cluster bootstrap) in its environment."""

    rank: int
    argv: tuple[str, ...]
    module: bool
    """argv[0] is a module (python -m), not a script."""
    env: Mapping[str, str]
    restart: bool = False
    """A life after the first."""


class RankStart(Protocol):
    """One way to start a rank's process."""

    def start(self, command: RankCommand) -> subprocess.Popen | None:
        """The rank's process, or None when this way cannot start it (the next way is tried)."""


class RankEnv:
    """The environment every rank shares, and one rank's."""

    def __init__(self, plan: LaunchPlan, ticket: Ticket, master_port: int, extra: Mapping[str, str],
                 unbuffered: bool):
        self.plan, self.ticket, self.master_port, self.unbuffered = plan, ticket, master_port, unbuffered
        self.extra = {**plan.env, **extra}

    def __call__(self, rank: int | None, **more: str) -> dict[str, str]:
        """The environment of rank `rank` (None: what every rank shares, a spare's)."""
        plan = self.plan
        env = {**os.environ, **self.extra, **more}
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
        if self.unbuffered:
            env.setdefault("PYTHONUNBUFFERED", "1")  # a pipe would hold the lines a terminal shows at once
        return env


class Fresh:
    """A fresh interpreter (`python SCRIPT` or `python -m MODULE`): always possible."""

    def __init__(self, output: RankOutput | None):
        self.output = output

    def start(self, command: RankCommand) -> subprocess.Popen:
        cmd = [sys.executable, *(["-m"] if command.module else []), *command.argv]
        return self.popen(cmd, dict(command.env))

    def popen(self, cmd: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        from troupe.runtime.forking import rank_leader

        pipes = self.output.pipes() if self.output is not None else {}
        leader = rank_leader("stdin" not in kwargs and os.isatty(0))  # a rank given stdin gets a pipe
        return subprocess.Popen(cmd, env=env, **leader, **pipes, **kwargs)


class Forked:
    """A fork of the zygote this launcher shares with its ranks: torch is imported already."""

    def __init__(self, output: RankOutput | None, zygotes: ZygoteSlot, shared_env: Callable[[], dict[str, str]],
                 fork_self: bool):
        self.output, self.zygotes, self.shared_env, self.fork_self = output, zygotes, shared_env, fork_self

    def zygote(self) -> Zygote | None:
        """The launcher's zygote (made at the first call), or None where ranks start afresh."""
        env = self.shared_env()
        if "torch" in sys.modules and self.fork_self:
            # A launcher forked by a `troupe fork-server` (runtime/forkserver.py) has torch: its zygote is forked
            # from it (one started afresh where it cannot be). Only here, at its first rank, where no `finally`
            # of the launcher's lies between this frame and `main` (a rank leaves through them: `ForkedChild`); an
            # elastic launcher forks in `load_torch`, before its own.
            self.zygotes.fork_shared(env)
        return self.zygotes.shared(env, say=lambda line: print(line, file=sys.stderr, flush=True))

    def start(self, command: RankCommand) -> subprocess.Popen | None:
        from troupe.runtime.spare import WARM_VAR

        house = self.zygote()
        if house is None:
            return None
        env = {**command.env, WARM_VAR: "1"} if command.restart else dict(command.env)  # Python not started anew
        pipes = [os.pipe(), os.pipe()] if self.output is not None else None
        try:
            proc = house.spawn(list(command.argv), env, module=command.module, stdout=pipes and pipes[0][1],
                               stderr=pipes and pipes[1][1])
        except OSError as e:
            print(f"troupe run: ranks start afresh from now on (the zygote failed: {e})", file=sys.stderr, flush=True)
            self.zygotes.forget(house)
            for r, _ in pipes or ():
                os.close(r)
            return None
        finally:
            for _, w in pipes or ():
                os.close(w)
        if pipes:
            proc.stdout, proc.stderr = os.fdopen(pipes[0][0], "rb"), os.fdopen(pipes[1][0], "rb")
        return proc


class Warm:
    """A spare started in advance (Python started, torch imported) takes a restarted rank's place."""

    def __init__(self, count: int, start_spare: Callable[[], subprocess.Popen]):
        from troupe.runtime.spare import Spares

        self.spares = Spares(count, start_spare)

    def start(self, command: RankCommand) -> subprocess.Popen | None:
        if not command.restart:
            return None
        proc = self.spares.take(dict(command.env))
        if proc is not None:
            self.spares.fill()  # the next spare starts now
        return proc

    def stop(self) -> None:
        self.spares.stop()


class Starter:
    """Starts this node's ranks with the job's environment (and, under --elastic, warm spares)."""

    def __init__(self, plan: LaunchPlan, ticket: Ticket, ports: Ports, output: RankOutput | None,
                 extra_env: Mapping[str, str] | None = None, zygotes: ZygoteSlot | None = None):
        self.plan, self.output = plan, output
        self.zygotes = ZygoteSlot() if zygotes is None else zygotes
        """The launcher's zygote (one for every attempt of its job)."""
        self.env = RankEnv(plan, ticket, ports.torch_port(ticket, plan.place), extra_env or {},
                           unbuffered=output is not None and sys.stdout.isatty())
        self.fresh = Fresh(output)
        self.forked = Forked(output, self.zygotes, lambda: self.env(None), fork_self=plan.mode == "fixed")
        self.warm: Warm | None = None
        self.started: set[int] = set()
        """The pids of every process this launcher started (ranks, spares): the orphans it inherits are the rest."""
        self._reaped_at = 0.0

    def __call__(self, rank: int, incarnation: int | None = None) -> subprocess.Popen:
        """Rank `rank` (its life `incarnation` under --elastic), in the first way that can start it."""
        server = rank in self.plan.servers.ranks
        more = {} if incarnation is None else {"TROUPE_INCARNATION": str(incarnation)}
        command = RankCommand(rank=rank, argv=("troupe.cluster.bootstrap",) if server else self.plan.argv,
                              module=server, env=self.env(rank, **more), restart=bool(incarnation))
        ways: list[RankStart] = [w for w in (self.warm, self.forked, self.fresh) if w is not None]
        proc = next(p for p in (way.start(command) for way in ways) if p is not None)
        self.started.add(proc.pid)
        if self.output is not None:
            self.output.attach(rank, proc)
        return proc

    def zygote(self):
        """Prepare the zygote before the first rank (see `Forked.zygote`)."""
        return self.forked.zygote()

    @property
    def forks(self) -> bool:
        """Whether this launcher's ranks were forked from a zygote (then restarts need no warm spares)."""
        return self.zygotes.current() is not None

    def keep_spares(self, count: int) -> None:
        """From now on a restart runs in one of `count` warm spares (started now)."""
        if self.warm is None and count:
            self.warm = Warm(count, self.spare)

    def spare(self) -> subprocess.Popen:
        """A process that imports torch now and runs the script as the rank it is handed later."""
        cmd = [sys.executable, "-m", "troupe.runtime.spare", *self.plan.argv]
        proc = self.fresh.popen(cmd, self.env(None), stdin=subprocess.PIPE)
        self.started.add(proc.pid)
        return proc

    def reap_orphans(self) -> None:
        """At most every 2 s: reap the exited orphans the launcher inherits as its forked ranks' subreaper."""
        from troupe.runtime.zygote import reap_orphans

        now = time.monotonic()
        house = self.zygotes.current()
        if house is None or now - self._reaped_at < 2.0:
            return
        self._reaped_at = now
        reap_orphans(self.started | {house.proc.pid})

    def stop(self) -> None:
        """End the warm spares nobody needed."""
        if self.warm is not None:
            self.warm.stop()
