"""An elastic job's store with a standby: node 0's launcher can die and the job goes on.

The job's store and its quorum live in node 0's launcher (runtime/lighthouse.py). In a job of several nodes whose
other nodes hold at least ``--min-groups`` worker groups, node 1's launcher keeps a standby: a second store, with a
lighthouse that does nothing until node 0's launcher is gone (launcher/standby.py). Its address is in the first
store (`STANDBY_KEY`). A worker reaches the job's store through a `FailoverStore`:

* while node 0's launcher lives, every operation goes to its store, and a round's decision (``q<id>/r<k>/d``) that
  this process reads or writes is copied to the standby by compare-and-set before it is used (`Failover.mirror`):
  the standby holds every decision a member may have applied;
* an operation that fails while node 0's store takes no connections makes the process wait for the standby to
  say it took over (`TAKEOVER_KEY`), then raises `FailedOver`; from then on every store of the process reaches
  the standby, and the caller decides what the failed operation meant. A process whose own launcher died (node
  0's ranks: they are re-parented) does not fail over, nobody could restart it: it leaves with `LostLauncher`.

What a worker does on `FailedOver` (`Elastic`, runtime/elastic.py): the round in flight, and every later round of
a quorum made before the failover, is decided at the standby by the first compare-and-set of `FAILOVER` (not
committed, no next quorum), and every member asks the standby's lighthouse to be admitted again; it forms a
quorum of the groups left, healed from the furthest trained. Why the survivors apply one decision per round: a
member applies a decision only once the standby holds it (mirrored before, or compare-and-set there after the
failover), and the standby keeps the first value written for a round. A member a round ahead of another left a
committed decision there, which the other then applies in its turn; the next round is the failover's.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("troupe.elastic")
STANDBY_KEY = "standby"
"""In node 0's store: ``HOST:PORT`` of node 1's launcher's standby store (same token, same prefix)."""
TAKEOVER_KEY = "takeover"
"""In the standby's store: set once its lighthouse keeps the job (node 0's launcher is gone)."""
ENDED_KEY = "ended"
"""In both stores: node 0's launcher left on purpose, with this exit code (the standby does not take over)."""
TAKEOVER_WAIT = 30.0
"""Seconds a worker waits for the standby to take over once node 0's store takes no connections (the standby
takes over after two refused connections a ping apart, or 15 s of silence: launcher/standby.py)."""
PROBE_SECONDS = 2.0
"""How long a worker tries to reach node 0's store before it counts it as gone."""
_DECISION = re.compile(r"(^|/)q\d+/r\d+/d$")
_ERRORS = (RuntimeError, ConnectionError, OSError)


class FailedOver(ConnectionError):
    """Node 0's launcher is gone and this process now reaches the standby's store: the operation did not happen
    (or did, on a store that no longer answers); the caller decides what it meant."""


def reachable(addr: str, port: int, timeout: float, tries: int = 3) -> bool:
    """Whether something takes TCP connections at `addr`:`port`, `tries` times 0.1 s apart, each within `timeout`
    seconds (a refused connection answers at once: nobody listens there; a process being killed may still accept
    one for a few milliseconds after its store stopped answering)."""
    for i in range(tries):
        try:
            with socket.create_connection((addr, port), timeout=timeout):
                pass
        except OSError:
            return False
        if i + 1 < tries:
            time.sleep(0.1)
    return True


class Failover:
    """Which of the job's two stores this process uses (`generation` 0: node 0's; 1: the standby's), shared by
    every `FailoverStore` of the process."""

    def __init__(self, primary: tuple[str, int], open_at: Callable[[str, int, float], Any], *,
                 launcher_pid: int | None = None, lost: Callable[[str], BaseException] = ConnectionError,
                 who: str = "this process"):
        self.primary, self.who = primary, who
        self.open_at = open_at
        """``open_at(host, port, timeout)``: a store client there, under the job's prefix."""
        self.standby: tuple[str, int] | None = None
        self.generation = 0
        self.launcher_pid = os.getppid() if launcher_pid is None else launcher_pid
        self.lost = lost
        """Makes the exception raised when there is nowhere to fail over to."""
        self._mirror: Any = None
        self._lock = threading.Lock()

    @property
    def target(self) -> tuple[str, int]:
        return self.primary if self.generation == 0 else self.standby

    def begin(self, standby: str | None) -> None:
        """A fresh process told the standby's address (``HOST:PORT``, `troupe run` sets TROUPE_STANDBY for a rank it
        starts once it knows it): when node 0's store takes no connections, wait for the standby to take over and
        start there (a rank restarted just after node 0's launcher died)."""
        if not standby:
            return
        host, port = standby.rsplit(":", 1)
        if (host, int(port)) == self.primary:  # (started after the takeover: the standby is its job's store)
            return
        self.standby = (host, int(port))
        if reachable(*self.primary, PROBE_SECONDS) and not self._taken_over():
            return
        try:
            self.fail_over(0, ConnectionError("node 0's store takes no connections"))
        except FailedOver:
            pass

    def connect(self, timeout: float) -> FailoverStore:
        return FailoverStore(self, timeout)

    def learn(self, store: Any) -> None:
        """Read the standby's address from node 0's store (a worker does when it joins a quorum: node 1's launcher
        writes it before it starts its ranks)."""
        if self.generation or self.standby is not None or not store.check([STANDBY_KEY]):
            return
        host, port = store.get(STANDBY_KEY).decode().rsplit(":", 1)
        self.standby = (host, int(port))

    def mirror(self, key: str, value: bytes) -> bytes:
        """`value`, the decision in `key` at node 0's store, once the standby holds it too; what the standby holds
        when it holds another (it took over: its value stands). Without a standby, or when it does not answer (node
        1's launcher is gone: no failover is left), `value` itself."""
        if self.standby is None or self.generation:
            return value
        try:
            if self._mirror is None:
                self._mirror = self.open_at(*self.standby, PROBE_SECONDS * 2)
            return self._mirror.compare_set(key, "", value)
        except _ERRORS as e:
            log.warning("troupe: the standby store at %s:%d does not answer (%s): no failover is left",
                        *self.standby, str(e).splitlines()[0][:120])
            self.standby, self._mirror = None, None
            return value

    def _taken_over(self) -> bool:
        """Whether the standby says it took over: then node 0's launcher is gone for the job even where its address
        still takes connections (a launcher stopped, or hung, whose host lives)."""
        if self.standby is None:
            return False
        try:
            return self.open_at(*self.standby, PROBE_SECONDS).check([TAKEOVER_KEY])
        except _ERRORS:
            return False

    def fail_over(self, seen: int, error: BaseException) -> None:
        """An operation of a store of generation `seen` failed with `error`: return when node 0's store still
        takes connections (the error was the operation's own: the caller raises it); move to the standby and raise
        `FailedOver`, or raise `lost(...)` when there is no standby to move to."""
        with self._lock:
            if self.generation != seen:
                raise FailedOver(f"the job's store moved to the standby at {self.standby[0]}:{self.standby[1]}")
            if self.generation == 1 or (reachable(*self.primary, PROBE_SECONDS) and not self._taken_over()):
                return  # (node 0's store still takes connections, and the standby has not taken over)
            first = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
            if self.standby is None:
                raise self.lost(first)
            deadline = time.monotonic() + TAKEOVER_WAIT
            while time.monotonic() < deadline:
                try:
                    probe = self.open_at(*self.standby, PROBE_SECONDS)
                    if probe.check([TAKEOVER_KEY]):
                        break
                except _ERRORS:
                    pass
                time.sleep(0.1)
            else:
                raise self.lost(f"{first} (the standby at {self.standby[0]}:{self.standby[1]} did not take over "
                                f"within {TAKEOVER_WAIT:.0f} s)")
            # Asked once the standby took over (a second or more after node 0's store closed): a process is
            # re-parented only as its dead parent's exit ends, after its sockets closed.
            if os.getppid() != self.launcher_pid:
                raise self.lost(f"{first} (this node's launcher is gone too)")
            self.generation = 1
            log.warning("troupe: %s reaches the job's store at the standby %s:%d (node 0's launcher is gone)",
                        self.who, *self.standby)
            log.debug("troupe: %s: what node 0's store said last: %s", self.who, first)
            raise FailedOver(f"the job's store moved to the standby at {self.standby[0]}:{self.standby[1]}")


class FailoverStore:
    """The job's store as a worker reaches it: node 0's, then the standby's (`Failover`). The operations the elastic
    wing uses; each raises `FailedOver` once, when the store moved under it (the operation is not retried: only the
    caller knows whether it may be)."""

    def __init__(self, failover: Failover, timeout: float):
        self.failover, self.timeout = failover, timeout
        self.generation = failover.generation
        self.inner = failover.open_at(*failover.target, timeout)
        """The store client of this generation (a torch Store: what a process group's rendezvous is made on)."""

    def current(self) -> Any:
        """The torch Store of the failover's generation now (reconnected if it moved)."""
        generation = self.failover.generation
        if self.generation != generation:
            self.inner = self.failover.open_at(*self.failover.target, self.timeout)
            self.generation = generation
        return self.inner

    def _call(self, name: str, *args: Any) -> Any:
        if self.generation != self.failover.generation:
            self.current()
            raise FailedOver(f"the job's store moved to the standby at {self.failover.target[0]}:"
                             f"{self.failover.target[1]}")
        try:
            return getattr(self.inner, name)(*args)
        except _ERRORS as e:
            try:
                self.failover.fail_over(self.generation, e)
            except FailedOver:
                self.current()
                raise
            raise  # node 0's store answers: the operation's own error

    def _decision(self, key: str, value: bytes) -> bytes:
        return self.failover.mirror(key, value) if _DECISION.search(key) and self.generation == 0 else value

    def get(self, key: str) -> bytes:
        return self._decision(key, self._call("get", key))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._decision(key, self._call("compare_set", key, expected, desired))

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def append(self, key: str, value: str) -> None:
        self._call("append", key, value)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def wait(self, keys: list[str], *timeout: Any) -> None:
        self._call("wait", keys, *timeout)
