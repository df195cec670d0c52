"""`troupe run --elastic`'s supervisor: restart a dead worker alone, never the others.

The launcher starts every rank, runs the `Lighthouse` (the quorum, in this process), and polls
the ranks: a rank that exits with an error is reported to the lighthouse (so the others' step
goes on without it at once) and started again after a back-off, as the same rank with the
next incarnation, until its restart budget is spent. A rank that finishes (exit 0) ends the
restarts: the job is closing. A rank out of budget stops the job, with one line naming it, and so
does a rank whose restart fails before its first step the same way its last life did (a bug or bad
input in the script's start-up: another life would fail alike).

In worker groups of several processes (`group_size` > 1) a rank that fails takes its whole group
out: the supervisor kills the group's other processes at once (they hold a replica that is now
incomplete) and restarts them all together. The budget stays per rank and counts only the rank
that failed: its partners were stopped, they did not fail.

What differs by the kind of job (let a dead server go, stop the job for a rank that cannot come
back, kill a frozen one) is asked of a `RestartPolicy` (`policies.py`); how processes start and
stop, of `Processes`; the membership (`House`) is told who was lost and who restarted.

    Supervisor(ranks, processes, house, policy, Rules(restarts_per_rank=10), say).run()
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from troupe.launcher.policies import LetGo, RestartPolicy, StopJob
from troupe.runtime.quorum import REJOIN_EXIT

POLL_SECONDS = 0.02
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 8.0
QUICK_SECONDS = 60.0
"""Restarts of one rank within this window double its back-off."""


class Processes(Protocol):
    """How the supervisor starts, kills and stops ranks."""

    def start(self, rank: int, incarnation: int) -> subprocess.Popen: ...

    def kill(self, proc: subprocess.Popen) -> None:
        """Kill one rank now and wait for it (a dead rank's worker-group partner; a frozen server)."""

    def stop_all(self, procs: list[subprocess.Popen]) -> None: ...

    def poll(self) -> None:
        """Runs at each look at the ranks (warm spares start there; it may raise KeyboardInterrupt)."""


class House(Protocol):
    """The membership the supervisor reports to (the lighthouse, or the parameter servers' keeper)."""

    def lost(self, rank: int, *, finished: bool = False) -> None: ...

    def restarted(self, rank: int) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Rules:
    """The supervisor's settings for one job."""

    restarts_per_rank: int
    """Restarts after a failure each rank may use before the job stops."""
    group_size: int = 1
    """Processes per worker group: a rank that fails takes its group's other processes out with it."""
    finish_closes: bool = True
    """The first rank to finish ends the restarts (synchronous groups finish together; asynchronous
    workers do not)."""
    left_out: str = "was left out of the quorum while it was paused"
    """What a rank that exits with REJOIN_EXIT went through (it starts again at once, not a failure)."""


@dataclass
class _Rank:
    proc: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    """Restarts after a failure (what the budget counts)."""
    starts: int = 1
    """Processes started for this rank (the next one's incarnation)."""
    recent: list[float] = field(default_factory=list)
    due: float | None = None
    """When a dead rank starts again (None: running, or finished)."""
    finished: bool = False
    early: str | None = None
    """How its last life failed, when that was before its first step (its last line of stderr)."""


def why(code: int) -> str:
    return f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"code {code}"


class _Stop(Exception):
    """The job stops with this exit code (every rank was stopped)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class Supervisor:
    """Runs `ranks` until all finish; restarts the dead ones alone (or with their worker group)."""

    def __init__(self, ranks: list[int], processes: Processes, house: House, policy: RestartPolicy, rules: Rules,
                 say: Callable[[str], None]):
        self.ranks, self.processes, self.house, self.policy, self.rules, self.say = \
            ranks, processes, house, policy, rules, say
        self.state: dict[int, _Rank] = {}
        self.closing = False

    def run(self) -> int:
        """The job's exit code: 0 when every rank finished (or was let go)."""
        self.state = {r: _Rank(self.processes.start(r, 0)) for r in self.ranks}
        try:
            while True:
                code = self._look()
                if code is not None:
                    return code
                self.processes.poll()
                time.sleep(POLL_SECONDS)
        except _Stop as stop:
            return stop.code
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (troupe run raises it): never leave a worker behind
            self.processes.stop_all([s.proc for s in self.state.values()])
            raise

    def _look(self) -> int | None:
        """One look at every rank; the job's exit code once it is over."""
        now = time.monotonic()
        self._kill_frozen()
        for rank, s in self.state.items():
            if s.finished:
                continue
            if s.due is not None:
                if now >= s.due and not self.closing:
                    self._start_again(rank, s, now)
                continue
            code = s.proc.poll()
            if code is not None:
                self._exited(rank, s, code, now)
        if all(s.finished for s in self.state.values()):
            return 0
        if self.closing and all(s.finished or s.due is not None for s in self.state.values()):
            down = sorted(r for r, s in self.state.items() if s.due is not None)
            self.say(f"troupe run: rank(s) {down} were down when the others finished; not restarted")
            return 0
        return None

    def _kill_frozen(self) -> None:
        for rank, reason in self.policy.on_freeze().items():
            s = self.state[rank]
            if not self.closing and not s.finished and s.due is None and s.proc.poll() is None:
                self.say(f"troupe run: rank {rank} {reason}; killing it")
                self.processes.kill(s.proc)  # seen dead at this look

    def _start_again(self, rank: int, s: _Rank, now: float) -> None:
        s.due, s.started = None, now
        s.proc = self.processes.start(rank, s.starts)
        s.starts += 1
        self.house.restarted(rank)

    def _exited(self, rank: int, s: _Rank, code: int, now: float) -> None:
        self.house.lost(rank, finished=code == 0)  # finished or dead, the others step on without it at once
        if code == 0:
            s.finished = True
            self.closing = self.closing or self.rules.finish_closes
            return
        if self.closing:
            self._stop(code, f"troupe run: rank {rank} exited with {why(code)} while the job was finishing")
        if code == REJOIN_EXIT:  # left out while paused: started afresh to catch up (not a failure)
            s.due = now
            self.say(f"troupe run: rank {rank} {self.rules.left_out}; starting it again to rejoin")
            return
        decision = self.policy.on_exit(rank, code)
        if isinstance(decision, LetGo):
            s.finished = True
            self.say(f"troupe run: rank {rank} exited with {why(code)}; {decision.why}; the others train on")
            return
        if isinstance(decision, StopJob):
            self._stop(code, f"troupe run: rank {rank} exited with {why(code)}; {decision.why}: stopped the job")
        self._check_failure(rank, s, code)
        self._restart(rank, s, code, now)

    def _check_failure(self, rank: int, s: _Rank, code: int) -> None:
        """Stop the job for the same failure before the first step twice in a row, or a budget spent."""
        early = self.policy.failed_early(rank, s.starts - 1, s.proc) if code > 0 else None  # not a kill
        failure, s.early = s.early, early
        if failure is not None and failure == s.early:
            self._stop(code, f"troupe run: rank {rank} failed again before its first step, the same way ({failure}): "
                             "not a fault to train through; stopped the job")
        budget = self.rules.restarts_per_rank
        if s.restarts >= budget:
            self._stop(code, f"troupe run: rank {rank} exited with {why(code)} and has used its {budget} "
                             "restarts (--restarts-per-rank); stopped the job")

    def _restart(self, rank: int, s: _Rank, code: int, now: float) -> None:
        budget, size = self.rules.restarts_per_rank, self.rules.group_size
        s.restarts += 1
        s.recent = [t for t in s.recent if now - t < QUICK_SECONDS] + [now]
        # The first restart in a while at once; more within QUICK_SECONDS back off, doubling.
        delay = 0.0 if len(s.recent) == 1 else min(BACKOFF_FIRST * 2 ** (len(s.recent) - 2), BACKOFF_MAX)
        s.due = now + delay
        if size == 1:
            self.say(f"troupe run: rank {rank} exited with {why(code)}; restarting it alone in {delay:.1f}s "
                     f"(restart {s.restarts} of {budget}); the others train on")
            return
        partners = self._stop_partners(rank, s.due)
        self.say(f"troupe run: rank {rank} exited with {why(code)}; stopped its worker group {rank // size}'s other "
                 f"ranks {partners} and restarting the group in {delay:.1f}s (restart {s.restarts} of "
                 f"{budget} for rank {rank}); the other groups train on")

    def _stop_partners(self, rank: int, due: float) -> list[int]:
        """Kill the other running processes of `rank`'s worker group and make them due with it (a partner
        already waiting to start again waits for the later of the two)."""
        size = self.rules.group_size
        first = rank - rank % size
        partners = [r for r in range(first, first + size) if r != rank and not self.state[r].finished]
        for r in partners:
            s = self.state[r]
            if s.due is None:
                self.processes.kill(s.proc)
                self.house.lost(r)
            s.due = due if s.due is None else max(s.due, due)
        return partners

    def _stop(self, code: int, line: str) -> None:
        self.say(line)
        self.processes.stop_all([s.proc for s in self.state.values()])
        raise _Stop(code if code > 0 else 128 - code)
