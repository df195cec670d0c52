"""Restart decisions under --elastic: what happens when a rank exits with an error, or freezes.

The supervisor (`supervisor.py`) owns the mechanism every elastic job shares (the restart budget,
the back-off, a worker group restarted whole, a failure before the first step seen twice). A
`RestartPolicy` owns what differs by the kind of job:

    policy.on_exit(rank, code)          -> RESTART | LetGo(why) | StopJob(why)
    policy.on_freeze()                  -> {rank: why} running ranks to kill now
    policy.failed_early(rank, life, p)  -> how that life failed before its first step, or None

`QuorumPolicy` serves elastic worker groups (the lighthouse refuses a rank that cannot rejoin);
`ServerFailover` serves parameter-server jobs (a dead separate server's workers may fail over).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from troupe.launcher.plan import Servers

if TYPE_CHECKING:
    from troupe.runtime.keeper import Keeper
    from troupe.runtime.lighthouse import Lighthouse, Reporter
    from troupe.runtime.rankio import RankOutput


@dataclass(frozen=True)
class Restart:
    """Start the rank again (its budget and back-off permitting)."""


RESTART = Restart()


@dataclass(frozen=True)
class LetGo:
    """Do not restart the rank; the job goes on without it."""

    why: str


@dataclass(frozen=True)
class StopJob:
    """Stop every rank: this one cannot come back."""

    why: str


Decision = Restart | LetGo | StopJob


class RestartPolicy(Protocol):
    """What to do when a rank exits with an error or freezes (the mechanism is the supervisor's)."""

    def on_exit(self, rank: int, code: int) -> Decision: ...

    def on_freeze(self) -> dict[int, str]: ...

    def failed_early(self, rank: int, life: int, proc: subprocess.Popen) -> str | None: ...


class QuorumPolicy:
    """Elastic worker groups: a dead rank restarts unless the lighthouse refused it (a restart would be
    refused again); the quorum itself evicts frozen ranks, so nothing is killed here."""

    def __init__(self, house: Lighthouse | Reporter, output: RankOutput | None):
        self.house, self.output = house, output

    def on_exit(self, rank: int, code: int) -> Decision:
        refused = self.house.refusal(rank)
        return RESTART if refused is None else StopJob(refused)

    def on_freeze(self) -> dict[int, str]:
        return {}

    def failed_early(self, rank: int, life: int, proc: subprocess.Popen) -> str | None:
        """How that life failed (its last line of stderr) when it never asked to join the quorum."""
        if self.output is None or self.house.asked(rank, life):
            return None
        # without torch's "[rankN]: " in front (its excepthook's), which differs from rank to rank
        return re.sub(r"^\[rank\d+\]:\s*", "", self.output.last_error_line(proc)) or None


class ServerFailover:
    """A parameter-server job under --elastic: a worker restarts alone; a dead separate server ends the
    job unless its workers can fail over to the same server of another server group (several server
    groups, asynchronous); a server frozen past --evict-after is killed so that they do."""

    def __init__(self, keeper: Keeper, servers: Servers, mine: list[int], evict_after: float):
        self.keeper, self.servers, self.evict_after = keeper, servers, evict_after
        self.mine = [r for r in mine if r in servers.ranks] if servers.fail_over else []
        """This node's separate servers that may be killed when frozen."""

    def on_exit(self, rank: int, code: int) -> Decision:
        gone = self._let_go(rank)
        if gone is not None:
            return LetGo(gone)
        refused = self.keeper.refusal(rank)  # a rank refused the job: a restart would be refused again
        if refused is not None:
            return StopJob(refused)
        if rank not in self.servers.ranks:
            return RESTART
        if self.servers.fail_over:  # not let go: every copy of its slices is gone
            index = self.servers.places[rank][1]
            return StopJob(f"server {index} of every server group is gone: no copy of its slices is left")
        return StopJob("a server cannot restart alone (its slices have no live copy to take over while it starts)")

    def _let_go(self, rank: int) -> str | None:
        """Why a dead server is not restarted while the job goes on (its workers fail over), or None."""
        if rank not in self.servers.ranks or not self.servers.fail_over:
            return None
        self.keeper.server_gone(rank)
        group, index = self.servers.places[rank]
        copies = self.servers.copies(index)
        if self.keeper.gone(copies) >= copies:
            return None
        return (f"it was server {index} of server group {group}, which is not restarted: its workers fail over to "
                f"server {index} of the next server group")

    def on_freeze(self) -> dict[int, str]:
        """This node's separate servers frozen past --evict-after (SIGSTOP, a hang), while another copy of
        their slices lives: killed, so that their workers fail over (a frozen server cannot come back as a
        frozen worker does: nothing would take its place while it restarts)."""
        out = {}
        for rank, still in self.keeper.frozen(self.mine, self.evict_after).items():
            group, index = self.servers.places[rank]
            others = self.servers.copies(index) - {rank}
            if self.keeper.gone(others) < others:
                out[rank] = (f"(server {index} of server group {group}) has not beaten for {still:.1f} s, past "
                             f"--evict-after {self.evict_after:g} s: frozen or hung")
        return out

    def failed_early(self, rank: int, life: int, proc: subprocess.Popen) -> str | None:
        return None
