"""Liveness through the job's store: a process is alive while its beat counter moves.

One key scheme, one encoding, one writer, one reader, for every process a launcher or a peer watches: an
elastic quorum's workers (read by the lighthouse, runtime/lighthouse.py), a parameter-server job's workers and
separate servers (read by their servers, their peers' `Lives` and the launcher's `Keeper`), and the nodes'
launchers (read by node 0's `Keeper`). Each beats by adding 1 to the counter under `key(who)` (`Beat`, a thread:
a frozen process's threads stop with it, a slow one's do not, so a counter standing still tells frozen from
slow); a watcher reads the counters of many processes in one ``multi_get`` and says how long each has stood
still (`Silence`).

The watchdog's heartbeat (runtime/watchdog.py, ``hb/<rank>``) is another thing: text that ranks of one fixed
job read from each other (the step and the collective a rank waits on, for a stall report), not a counter a
watcher counts on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist  # not imported at run time: the launcher's `troupe run` stays light

log = logging.getLogger("troupe.elastic")

Who = int | str
"""A rank, or another process's name (``"node/1"``, a node's launcher)."""

BEAT_SECONDS = 0.5
"""How often a parameter-server job's processes beat (an elastic quorum's workers beat every
``ElasticOptions.heartbeat``)."""

_STORE_ERRORS = (RuntimeError, ConnectionError, OSError)


def key(who: Who) -> str:
    """The store key of `who`'s beat counter."""
    return f"beat/{who}"


class Beat:
    """A thread that adds 1 to `who`'s counter every `every` seconds, on a store connection of its own
    (``connect()``), after a first beat made in `start` (a watcher may count from the process's start, and the
    process may be watched before its thread's first beat).

    A beat that fails is retried on a fresh connection at the next one if `reconnect` (an elastic worker's: a
    slow store on a loaded host would otherwise get it evicted), else the thread ends (the launcher's store is
    gone with the job; a thread kept inside a store call as the interpreter ends aborts the process)."""

    def __init__(self, who: Who, connect: Callable[[], dist.Store], every: float, *, reconnect: bool = True,
                 name: str = "troupe-beat"):
        self.who, self.connect, self.every, self.reconnect = who, connect, every, reconnect
        self._store: dist.Store | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Beat:
        self._store = self.connect()
        self._store.add(key(self.who), 1)
        self._thread.start()
        return self

    def stop(self, wait: float = 0.0) -> None:
        """No more beats; wait up to `wait` seconds for the thread to end (0: do not wait)."""
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join(wait)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self._store.add(key(self.who), 1)
            except _STORE_ERRORS as e:
                if not self.reconnect:
                    return
                log.debug("troupe: %s: a beat failed (%s); reconnecting", self.who, e)
                try:
                    self._store = self.connect()
                except _STORE_ERRORS:
                    pass  # the launcher is gone or busy: the main thread finds out on its own


class Silence:
    """How long each watched process's beat counter has stood still, on this process's monotonic clock.

    `read` fetches the counters of many processes in one ``multi_get`` (a watcher of thousands of processes
    would spend its tick reading them one by one); a counter that moved since the last read is heard now. A
    process is counted from when it is first read or `expect`-ed (a process still starting has had that long);
    `started` says whether it has beaten at all."""

    def __init__(self, store: dist.Store, expected: Iterable[Who] = (), now: float | None = None):
        self.store = store
        self.seen: dict[Who, tuple[int, float]] = {}
        """Per process: its counter when it last moved (-1: not read yet), and when (monotonic)."""
        self._made: set[Who] = set()
        """Processes whose counter exists in the store (made here at 0 if it did not: ``multi_get`` of a missing
        key would wait for the store's timeout)."""
        for who in expected:
            self.expect(who, now)

    def expect(self, who: Who, now: float | None = None) -> None:
        """Count `who` afresh (a process that starts again, or one not started yet): silent since `now` until the
        next `read`, which hears it whatever its counter says (the counter goes on from its last process's)."""
        if who not in self._made:
            self.store.add(key(who), 0)
            self._made.add(who)
        self.seen[who] = (-1, time.monotonic() if now is None else now)

    def read(self, whos: Iterable[Who], now: float | None = None) -> None:
        """Read these processes' counters, in one message."""
        whos = list(whos)
        if not whos:
            return
        now = time.monotonic() if now is None else now
        for who in whos:
            if who not in self._made:
                self.store.add(key(who), 0)
                self._made.add(who)
        for who, count in zip(whos, self.store.multi_get([key(w) for w in whos])):
            last = self.seen.get(who, (None, 0.0))
            if last[0] != int(count):  # (a process `expect`-ed with time to come keeps it: `Lighthouse.take_over`)
                self.seen[who] = (int(count), max(now, last[1]))

    def silent_for(self, who: Who, now: float | None = None) -> float:
        """Seconds since `who`'s counter last moved (as of the last `read`; 0 if it was never read)."""
        now = time.monotonic() if now is None else now
        return now - self.seen[who][1] if who in self.seen else 0.0

    def look(self, whos: Iterable[Who]) -> dict[Who, float]:
        """`read` these processes now; how long each has been silent."""
        whos, now = list(whos), time.monotonic()
        self.read(whos, now)
        return {who: self.silent_for(who, now) for who in whos}

    def started(self, who: Who) -> bool:
        """Whether `who` had beaten at least once when last read."""
        return self.seen.get(who, (0, 0.0))[0] > 0

    def forget(self, who: Who) -> None:
        """Stop counting `who` (read again later, it is counted from then)."""
        self.seen.pop(who, None)
