"""Node 1's elastic launcher: a standby that keeps the job when node 0's launcher dies.

Node 0's `troupe run --elastic` hosts the job's store and its quorum (runtime/lighthouse.py). In a job of several
nodes whose other nodes hold at least ``--min-groups`` worker groups, node 1's launcher also hosts a standby store
with a lighthouse of its own, idle, and writes the standby's address into node 0's store (runtime/failover.py says
how the workers use it). Until node 0's launcher is gone, node 1's launcher reports its ranks to node 0's lighthouse
(`Reporter`), as every other node's does. A thread asks node 0's store a cheap question every `PING_SECONDS`; when
two questions in a row fail and node 0's address refuses connections (its launcher died: nothing listens there), or
it has been silent for `STORE_SILENCE_SECONDS` (a host gone), this launcher takes over: its lighthouse counts node
0's ranks as gone (their launcher cannot restart them), says so in the standby's store (the workers waiting for it
reconnect there), forms the next quorum from the groups that ask, and from then on hears this node's ranks itself;
a rank it restarts is given the standby's ticket. Node 0's launcher leaving on purpose (the job failed or was stopped
there: SIGTERM, Ctrl-C) says so in the standby's store first (`Lighthouse.end`): node 1's launcher then stops its
ranks at once instead of taking over.

What is left out: a job whose other nodes hold fewer than ``--min-groups`` groups has no standby (its other nodes
end within 15 s, in one line, as before: `StoreWatch`); on three nodes or more, only node 1 keeps a standby and the
launchers of nodes 2 and up still end their ranks when node 0's store is silent (their ranks would fail over).
Node 0's launcher and node 1's both lost at once end the job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from troupe.launcher.elastic import PING_SECONDS, STORE_SILENCE_SECONDS, EndedElsewhere
from troupe.runtime.quorum import ElasticOptions
from troupe.runtime.ticket import Ticket


def groups_without_node_0(options: ElasticOptions, nproc: int, nnodes: int) -> set[int]:
    """The worker groups none of whose processes run on node 0 (each node runs `nproc` ranks, node 0 the first)."""
    k = options.group_size
    return {r // k for r in range(nproc, nproc * nnodes)} - {r // k for r in range(nproc)}


class Standby:
    """The supervisor's house on node 1: node 0's lighthouse through a `Reporter` until node 0's launcher is gone,
    then a lighthouse of its own (see the module's docstring)."""

    def __init__(self, ticket: Ticket, options: ElasticOptions, nproc: int, say: Callable[[str], None],
                 join_timeout: float, on_take_over: Callable[[Ticket], None] = lambda ticket: None):
        from troupe.runtime.failover import STANDBY_KEY
        from troupe.runtime.lighthouse import Lighthouse, Reporter
        from troupe.runtime.netif import source_address

        self.ticket, self.say, self.on_take_over = ticket, say, on_take_over
        self.gone = set(range(nproc))
        """Node 0's ranks."""
        self.reporter = Reporter(ticket, join_timeout)
        self.standby = Ticket(addr=source_address(ticket.addr), token=ticket.token)  # (a free port)
        self.house = Lighthouse(self.standby, options, say=say)  # hosts the standby store; idle until `take_over`
        self.reporter.store.set(STANDBY_KEY, f"{self.standby.addr}:{self.standby.port}")
        self.active: Lighthouse | Reporter = self.reporter
        self.took_over = False
        self.closed = False
        """Node 0's lighthouse closed the job (its members finished): a silence then is the job's end."""
        self.answered = time.monotonic()
        self.failed = 0
        """Questions to node 0's store failed in a row."""
        self.refused = False
        self.ended: int | None = None
        """Node 0's launcher's exit code, when it left on purpose (it says so in the standby's store)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ping, name="troupe-standby", daemon=True)
        self._thread.start()

    # --- the supervisor's house (`Lighthouse` / `Reporter`) --------------------------------------

    def lost(self, rank: int, *, finished: bool = False) -> None:
        self.active.lost(rank, finished=finished)

    def restarted(self, rank: int) -> None:
        self.active.restarted(rank)

    def asked(self, rank: int, incarnation: int) -> bool:
        return self.active.asked(rank, incarnation)

    def refusal(self, rank: int) -> str | None:
        return self.active.refusal(rank)

    @property
    def formed_once(self) -> bool:
        return self.active.formed_once

    def done(self) -> bool:
        return self.house.done() if self.took_over else True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3 * PING_SECONDS + 1.0)
        self.house.stop()

    # --- watching node 0 -------------------------------------------------------------------

    def _ping(self) -> None:
        from troupe.runtime.failover import reachable
        from troupe.runtime.launch import open_store

        from troupe.runtime.failover import ENDED_KEY

        store = None
        while not self._stop.wait(PING_SECONDS):
            try:
                if self.house.store.check([ENDED_KEY]):
                    self.ended = int(self.house.store.get(ENDED_KEY))
            except (RuntimeError, ConnectionError, OSError, ValueError):
                pass
            try:
                if store is None:
                    store = open_store(self.ticket, False, PING_SECONDS)
                self.closed = store.check([f"troupe/{self.ticket.token}/closed"])
                self.answered, self.failed, self.refused = time.monotonic(), 0, False
            except (RuntimeError, ConnectionError, OSError):
                store = None
                self.failed += 1
                if self.failed >= 2:
                    self.refused = not reachable(self.ticket.addr, self.ticket.port, PING_SECONDS)

    def check(self) -> None:
        """From the supervisor's loop: take over once node 0's launcher is gone (see the module's docstring)."""
        if self.took_over:
            return
        silent = time.monotonic() - self.answered
        if self.ended:
            self.say(f"troupe run: node 0's launcher ended the job (exit code {self.ended}); stopping this node's ranks")
            raise EndedElsewhere(1)
        if self.closed or self.ended == 0:  # the job is over: a silence now is node 0's launcher leaving
            if silent > STORE_SILENCE_SECONDS:
                self.say(f"troupe run: node 0's launcher (the job's store at {self.ticket.addr}:{self.ticket.port}) "
                         f"has not answered for {silent:.0f} s after the job ended; stopping this node's ranks")
                raise EndedElsewhere(1)
            return
        if not (self.refused or silent > STORE_SILENCE_SECONDS):
            return
        self.took_over = True
        self.say(f"troupe run: node 0's launcher (the job's store at {self.ticket.addr}:{self.ticket.port}) is gone "
                 f"({'it refuses connections' if self.refused else f'silent for {silent:.0f} s'}); this node's "
                 f"launcher keeps the job (standby store at {self.standby.addr}:{self.standby.port}); node 0's "
                 f"ranks {sorted(self.gone)} are lost")
        self.on_take_over(self.standby)
        self.house.take_over(self.gone)
        self.active = self.house
