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

The launchers of nodes 2 and up follow (`Follower`): they report to node 0's lighthouse, and once node 0's store
stops answering and the standby says it took over, to the standby's; a rank they restart then is given the
standby's ticket.

What is left out: a job whose other nodes hold fewer than ``--min-groups`` groups has no standby (its other nodes
end within 15 s, in one line, as before: `StoreWatch`). Node 0's launcher and node 1's both lost at once end the
job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from troupe.launcher.elastic import PING_SECONDS, STORE_SILENCE_SECONDS, EndedElsewhere
from troupe.runtime.quorum import ElasticOptions
from troupe.runtime.ticket import Ticket


UNREACHED_SECONDS = 60.0
"""After a takeover, how long the standby waits for a rank to ask to be admitted before it ends this node's part: a
node 0 launcher that stopped (SIGSTOP, a hang) while its host lives keeps accepting connections, and a worker's store
call on it never returns (torch's TCPStore client sets no bound on a connected server that stops answering)."""


def job_store(ticket: Ticket, timeout: float):
    """A client of the job's store at `ticket`, under the job's prefix (as the lighthouse and the workers see it)."""
    import torch.distributed as dist

    from troupe.runtime.launch import open_store

    return dist.PrefixStore(f"troupe/{ticket.token}/", open_store(ticket, False, timeout))


def groups_without_node_0(options: ElasticOptions, nproc: int, nnodes: int) -> set[int]:
    """The worker groups none of whose processes run on node 0 (each node runs `nproc` ranks, node 0 the first)."""
    k = options.group_size
    return {r // k for r in range(nproc, nproc * nnodes)} - {r // k for r in range(nproc)}


class _House:
    """The supervisor's house calls (`Lighthouse` / `Reporter`), passed to whichever keeps the job now (`active`)."""

    active: Any

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


class Standby(_House):
    """The supervisor's house on node 1: node 0's lighthouse through a `Reporter` until node 0's launcher is gone,
    then a lighthouse of its own (see the module's docstring)."""

    def __init__(self, ticket: Ticket, options: ElasticOptions, nproc: int, say: Callable[[str], None],
                 join_timeout: float, on_take_over: Callable[[Ticket], None] = lambda ticket: None,
                 on_standby: Callable[[str], None] = lambda addr: None):
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
        on_standby(f"{self.standby.addr}:{self.standby.port}")
        self.active: Lighthouse | Reporter = self.reporter
        self.took_over = False
        self.took_over_at = 0.0
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

    def done(self) -> bool:
        return self.house.done() if self.took_over else True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3 * PING_SECONDS + 1.0)
        self.house.stop()

    # --- watching node 0 -------------------------------------------------------------------

    def _ping(self) -> None:
        from troupe.runtime.failover import reachable

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
                    store = job_store(self.ticket, PING_SECONDS)
                self.closed = store.check(["closed"])
                self.answered, self.failed, self.refused = time.monotonic(), 0, False
            except (RuntimeError, ConnectionError, OSError):
                store = None
                self.failed += 1
                if self.failed >= 2:
                    self.refused = not reachable(self.ticket.addr, self.ticket.port, PING_SECONDS)

    def check(self) -> None:
        """From the supervisor's loop: take over once node 0's launcher is gone (see the module's docstring); end
        this node's part when, after the takeover, no rank asks here within `UNREACHED_SECONDS`."""
        if self.took_over:
            waited = time.monotonic() - self.took_over_at
            if waited > UNREACHED_SECONDS and not self.house.requests:
                self.say(f"troupe run: no rank reached the standby store within {waited:.0f} s of the takeover (node "
                         f"0's launcher stopped answering but its address still takes connections, and torch's store "
                         f"client waits on it without a bound); stopping this node's ranks")
                raise EndedElsewhere(1)
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
        self.took_over, self.took_over_at = True, time.monotonic()
        self.say(f"troupe run: node 0's launcher (the job's store at {self.ticket.addr}:{self.ticket.port}) is gone "
                 f"({'it refuses connections' if self.refused else f'silent for {silent:.0f} s'}); this node's "
                 f"launcher keeps the job (standby store at {self.standby.addr}:{self.standby.port}); node 0's "
                 f"ranks {sorted(self.gone)} are lost")
        self.on_take_over(self.standby)
        self.house.take_over(self.gone)
        self.active = self.house


class Follower(_House):
    """The supervisor's house on node 2 and up, when node 1 keeps a standby: node 0's lighthouse through a `Reporter`,
    then the standby's once node 0's store stops answering and the standby took over (see the module's docstring);
    until then, and without a standby, node 0's store silent for 15 s ends this node's part (`StoreWatch`)."""

    def __init__(self, ticket: Ticket, say: Callable[[str], None], join_timeout: float,
                 on_take_over: Callable[[Ticket], None] = lambda ticket: None,
                 on_standby: Callable[[str], None] = lambda addr: None):
        from troupe.launcher.elastic import StoreWatch
        from troupe.runtime.lighthouse import Reporter

        self.ticket, self.say, self.join_timeout, self.on_take_over = ticket, say, join_timeout, on_take_over
        self.on_standby = on_standby
        self.reporter = Reporter(ticket, join_timeout)
        self.watch = StoreWatch(ticket, say)
        self.standby: Ticket | None = None
        self.followed = False
        self._looked = 0.0

    @property
    def active(self):  # noqa: ANN201  (a Reporter: node 0's lighthouse's, then the standby's)
        return self.reporter

    def stop(self) -> None:
        self.watch.stop()

    def check(self) -> None:
        """From the supervisor's loop, once a second: learn the standby's address while node 0's store answers; then
        follow the standby as soon as it says it took over; else end as `StoreWatch` does."""
        from troupe.runtime.failover import STANDBY_KEY, TAKEOVER_KEY

        now = time.monotonic()
        silent = now - self.watch.answered
        if now - self._looked >= PING_SECONDS:
            self._looked = now
            try:
                if self.standby is None and silent < PING_SECONDS and self.reporter.store.check([STANDBY_KEY]):
                    host, port = self.reporter.store.get(STANDBY_KEY).decode().rsplit(":", 1)
                    self.standby = Ticket(addr=host, port=int(port), token=self.ticket.token)
                    self.on_standby(f"{host}:{port}")
                elif self.standby is not None and not self.followed:
                    self._follow(TAKEOVER_KEY)
            except (RuntimeError, ConnectionError, OSError):
                pass  # node 0's store, or the standby's, does not answer now: asked again a second later
        self.watch.check()

    def _follow(self, takeover_key: str) -> None:
        from troupe.launcher.elastic import StoreWatch
        from troupe.runtime.lighthouse import Reporter

        if not job_store(self.standby, PING_SECONDS).check([takeover_key]):
            return
        self.followed = True
        self.reporter = Reporter(self.standby, self.join_timeout)
        self.watch.stop()
        self.watch = StoreWatch(self.standby, self.say)
        self.on_take_over(self.standby)
        self.say(f"troupe run: node 0's launcher is gone; this node follows the standby at {self.standby.addr}:"
                 f"{self.standby.port} (node 1's launcher)")
