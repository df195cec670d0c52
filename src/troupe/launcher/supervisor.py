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
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from troupe.runtime.quorum import REJOIN_EXIT

POLL_SECONDS = 0.02
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 8.0
QUICK_SECONDS = 60.0
"""Restarts of one rank within this window double its back-off."""


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


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def supervise(spawn: Callable[[int, int], subprocess.Popen], ranks: list[int], lighthouse, *,
              restarts_per_rank: int, say: Callable[[str], None], stop_all: Callable[[list], None],
              every_poll: Callable[[], None] = lambda: None, group_size: int = 1,
              kill: Callable[[subprocess.Popen], None] = _kill,
              fixed: Callable[[int], str | None] = lambda rank: None, finish_closes: bool = True,
              left_out: str = "was left out of the quorum while it was paused",
              let_go: Callable[[int], str | None] = lambda rank: None,
              frozen: Callable[[], dict[int, str]] = dict,
              early: Callable[[int, int, subprocess.Popen], str | None] = lambda rank, life, proc: None) -> int:
    """Run `ranks` (each `spawn(rank, incarnation)`) until all finish; restart the dead ones alone (with
    `group_size` > 1, with the rest of their worker group, which `kill` stops and waits for).
    `every_poll()` runs at each look at the processes (the launcher starts its spares there).
    `fixed(rank)`: why that rank cannot restart alone (its death stops the job), or None.
    `let_go(rank)`: asked first, why that rank is not restarted and the job goes on without it (a separate
    server whose workers fail over to another server group), or None.
    `finish_closes`: the first rank to finish ends the restarts (synchronous groups finish together;
    asynchronous workers do not). `left_out`: what a rank that exits with REJOIN_EXIT went through (it is
    started again at once, not counted as a failure). `frozen()`: at each look, running ranks to kill now
    ({rank: why}; a frozen separate server: its death is then handled as any other, by `let_go`).
    `early(rank, life, proc)`: how that life of the rank failed if it failed before its first step, else None;
    two lives in a row that fail so, the same way, stop the job (a bug or bad input, not a fault to train through)."""
    state = {r: _Rank(spawn(r, 0)) for r in ranks}
    try:
        return _watch(state, spawn, lighthouse, restarts_per_rank, say, stop_all, every_poll, group_size, kill,
                      fixed, finish_closes, left_out, let_go, frozen, early)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (troupe run raises it): never leave a worker behind
        stop_all([s.proc for s in state.values()])
        raise


def _watch(state: dict[int, _Rank], spawn, lighthouse, restarts_per_rank: int, say, stop_all, every_poll,
           group_size: int, kill, fixed, finish_closes: bool, left_out: str, let_go, frozen, early) -> int:
    closing = False
    while True:
        now = time.monotonic()
        for rank, reason in frozen().items():
            s = state[rank]
            if not closing and not s.finished and s.due is None and s.proc.poll() is None:
                say(f"troupe run: rank {rank} {reason}; killing it")
                kill(s.proc)  # seen dead at this look, below
        for rank, s in state.items():
            if s.finished:
                continue
            if s.due is not None:
                if now >= s.due and not closing:
                    s.due, s.started = None, now
                    s.proc = spawn(rank, s.starts)
                    s.starts += 1
                    lighthouse.restarted(rank)
                continue
            code = s.proc.poll()
            if code is None:
                continue
            lighthouse.lost(rank, finished=code == 0)  # finished or dead, the others step on without it at once
            if code == 0:
                s.finished = True
                closing = closing or finish_closes
                continue
            if closing:
                say(f"troupe run: rank {rank} exited with {why(code)} while the job was finishing")
                stop_all([x.proc for x in state.values()])
                return code if code > 0 else 128 - code
            if code == REJOIN_EXIT:  # left out while paused: started afresh to catch up (not a failure)
                s.due = now
                say(f"troupe run: rank {rank} {left_out}; starting it again to rejoin")
                continue
            gone = let_go(rank)
            if gone is not None:
                s.finished = True
                say(f"troupe run: rank {rank} exited with {why(code)}; {gone}; the others train on")
                continue
            reason = fixed(rank)
            if reason is not None:
                say(f"troupe run: rank {rank} exited with {why(code)}; {reason}: stopped the job")
                stop_all([x.proc for x in state.values()])
                return code if code > 0 else 128 - code
            failure, s.early = s.early, early(rank, s.starts - 1, s.proc) if code > 0 else None  # not a kill
            if failure is not None and failure == s.early:
                say(f"troupe run: rank {rank} failed again before its first step, the same way ({failure}): not a "
                    "fault to train through; stopped the job")
                stop_all([x.proc for x in state.values()])
                return code if code > 0 else 128 - code
            if s.restarts >= restarts_per_rank:
                say(f"troupe run: rank {rank} exited with {why(code)} and has used its {restarts_per_rank} "
                    "restarts (--restarts-per-rank); stopped the job")
                stop_all([x.proc for x in state.values()])
                return code if code > 0 else 128 - code
            s.restarts += 1
            s.recent = [t for t in s.recent if now - t < QUICK_SECONDS] + [now]
            # The first restart in a while at once; more within QUICK_SECONDS back off, doubling.
            delay = 0.0 if len(s.recent) == 1 else min(BACKOFF_FIRST * 2 ** (len(s.recent) - 2), BACKOFF_MAX)
            s.due = now + delay
            if group_size == 1:
                say(f"troupe run: rank {rank} exited with {why(code)}; restarting it alone in {delay:.1f}s "
                    f"(restart {s.restarts} of {restarts_per_rank}); the others train on")
                continue
            group = rank // group_size
            partners = _stop_partners(state, rank, group_size, s.due, lighthouse, kill)
            say(f"troupe run: rank {rank} exited with {why(code)}; stopped its worker group {group}'s other "
                f"ranks {partners} and restarting the group in {delay:.1f}s (restart {s.restarts} of "
                f"{restarts_per_rank} for rank {rank}); the other groups train on")
        if all(s.finished for s in state.values()):
            return 0
        if closing and all(s.finished or s.due is not None for s in state.values()):
            down = sorted(r for r, s in state.items() if s.due is not None)
            say(f"troupe run: rank(s) {down} were down when the others finished; not restarted")
            return 0
        every_poll()
        time.sleep(POLL_SECONDS)


def _stop_partners(state: dict[int, _Rank], rank: int, group_size: int, due: float, lighthouse, kill) -> list[int]:
    """Kill the other running processes of `rank`'s worker group and make them due with it (a partner
    already waiting to start again waits for the later of the two)."""
    first = rank - rank % group_size
    partners = [r for r in range(first, first + group_size) if r != rank and not state[r].finished]
    for r in partners:
        s = state[r]
        if s.due is None:
            kill(s.proc)
            lighthouse.lost(r)
        s.due = due if s.due is None else max(s.due, due)
    return partners
