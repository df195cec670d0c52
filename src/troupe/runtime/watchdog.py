"""Watchdog: heartbeats through the rendezvous store, a stall inspector, and failure reports.

Every rank's background thread writes ``hb/<rank>`` = "time step waiting-on" to the
job's store once per `interval`. With that:

* a rank that waits on a collective longer than `stall_seconds` logs which ranks have
  not reached its step and what it is waiting on (Horovod's stall inspector);
* a rank whose peer stops beating for `peer_timeout` seconds (a hung or vanished
  machine, which TCP alone may not notice for minutes) stops with that peer's name;
* when a collective fails, `explain()` turns the backend's error into one line that
  names the rank(s) that died or raised, and the step.

A rank that dies of a Python exception first records it under ``failed/<rank>``.

This heartbeat is not the liveness of runtime/liveness.py (a counter a launcher or a server watches to tell
a frozen process from a slow one, and evicts or restarts it): it is text the ranks of one job read from
each other, for what it carries (the step, the collective waited on) as much as for its being fresh, and it
ends the job rather than leave a rank out.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

from troupe.runtime.settings import Settings
import torch.distributed as dist

log = logging.getLogger("troupe")


T = TypeVar("T")


def bounded(call: Callable[[], T], seconds: float, what: str) -> T:
    """`call()`'s result, or TimeoutError(`what`) when it has not returned within `seconds` (it is
    left running in its daemon thread: blocking socket calls cannot be interrupted)."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as e:  # handed to the caller
            box.append((False, e))

    thread = threading.Thread(target=run, name="troupe-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if not box:
        raise TimeoutError(f"{what} within {seconds:g}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


class PeerFailure(RuntimeError):
    """A collective failed because another rank died, raised, or stopped responding."""


class Watchdog:
    """Heartbeat thread plus the bookkeeping the main thread updates (step, current wait)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, env: Settings,
                 reconnect: Callable[[], dist.Store] | None = None, where: str = "the job's rendezvous",
                 refusals: Callable[[], int] | None = None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval, self.stall_seconds, self.peer_timeout = env.heartbeat, env.stall_seconds, env.peer_timeout
        self.store_timeout = env.store_timeout
        self.reconnect, self.where = reconnect, where
        self.refusals, self.refused = refusals, 0
        if refusals is not None:
            try:
                self.refused = bounded(refusals, self.store_timeout, "the refusal count")  # those logged at join
            except Exception:
                pass
        """Rank 0 counts join attempts with a wrong token while the job runs, and logs each new one."""
        self.step = 0
        self.waiting_on: str | None = None
        self.waiting_since = 0.0
        self._last_stall_report = 0.0
        self._seen: dict[int, tuple[str, float]] = {}
        """Each peer's last heartbeat text and when (this host's monotonic clock) it last changed:
        staleness is judged by this host's clock alone, so clock skew between hosts does not matter."""
        self._cut_off: tuple[float, int] | None = None
        """(since when, at which step) this rank has not reached the store."""
        self._store_exited = False
        self._last_poll = time.monotonic()
        self.expendable: set[int] = set()
        """Ranks the job goes on without (asynchronous parameter-server workers): their silence is
        reported once, not fatal; `alive()` then says False and their servers forget them."""
        self._forgotten: set[int] = set()
        self.unwatched: set[int] = set()
        """Ranks whose silence means nothing here: workers that restart alone (`troupe run --elastic` over
        parameter servers; their servers watch their links, and a restarted one does not beat)."""
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="troupe-watchdog", daemon=True)
        self._thread.start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self.stop)

    def alive(self, rank: int) -> bool:
        """False once `rank` said it exited, or its heartbeat has been silent for TROUPE_PEER_TIMEOUT
        while this rank could read the store (cut off itself, it cannot tell and says True)."""
        seen = self._seen.get(rank)
        if seen is None:
            return True
        if seen[0].startswith("exit"):
            return False
        reading = time.monotonic() - self._last_poll < 2 * self.interval + self.store_timeout
        return not reading or time.monotonic() - seen[1] <= self.peer_timeout

    # --- main thread ---------------------------------------------------------------------

    @contextmanager
    def waiting(self, what: str):
        """Mark the main thread as blocked in a collective on `what` (the outermost label wins)."""
        if self.waiting_on is not None:
            yield
            return
        self.waiting_on, self.waiting_since = what, time.monotonic()
        try:
            yield
        finally:
            self.waiting_on = None

    def explain(self, error: BaseException) -> PeerFailure:
        """A PeerFailure naming the failed rank(s) and this rank's step, for a failed collective."""
        what = self.waiting_on or "a collective"
        culprits = self._culprits()
        return PeerFailure(f"rank {self.rank}: {what} failed at step {self.step}: {culprits} "
                           f"[backend: {str(error).splitlines()[0][:200]}]")

    def stop(self) -> None:
        """Stop beating and tell the peers this rank exited (so its silence is not taken for a hang).
        In an asynchronous cluster rank 0, which hosts the store, first waits while other ranks still
        beat: servers and slower workers keep their rendezvous, and a cut-off worker is still
        noticed (and forgotten by its servers) after TROUPE_PEER_TIMEOUT."""
        if self._stop.is_set():
            return
        if self.rank == 0 and self.expendable:
            self._outlive_peers()
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)
        sys.excepthook = self._previous_hook
        try:
            self._ask(lambda store: store.set(f"hb/{self.rank}", f"exit {self.step}"))
        except Exception:
            pass  # rank 0 (the store) already left

    def _outlive_peers(self) -> None:
        while True:
            try:
                beating, _ = self._peers()
            except Exception:
                return
            fresh = 3 * self.interval + self.store_timeout
            working = {r for r, (age, _, _) in beating.items() if age <= fresh}
            if not working:
                return
            self.waiting_on = self.waiting_on or f"ranks {sorted(working)} to finish (this rank hosts the store)"
            time.sleep(self.interval / 4)

    # --- heartbeat thread ------------------------------------------------------------------

    def _ask(self, op: Callable[[dist.Store], T]) -> T:
        """`op` on the store within TROUPE_STORE_TIMEOUT, else TimeoutError. TCPStore's own timeout does
        not cover a connection whose peer went silent (a partition, a pulled cable): its calls then
        block for good, so each runs in a thread that is abandoned if it does not answer in time."""
        return bounded(lambda: op(self.store), self.store_timeout, f"{self.where} did not answer")

    def _beat(self) -> None:
        self._ask(lambda store: store.set(f"hb/{self.rank}", f"{time.time():.3f} {self.step} {self.waiting_on or '-'}"))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                self._inspect()
                self._cut_off = None
            except Exception as e:
                if self._lost_store(e):
                    return

    def _lost_store(self, error: Exception) -> bool:
        """The store did not answer. True: stop beating (it ended with the job). Else reconnect and
        go on; a rank blocked in a collective while cut off for TROUPE_PEER_TIMEOUT stops, naming
        the store's host (a network partition or a dead host), since it can never finish."""
        if self._stop.is_set() or self._store_exited:
            return True  # rank 0 left normally, or this rank is leaving: nothing to watch
        if self.reconnect is None:
            return True  # nothing to reconnect to (an external store): the next collective reports
        now = time.monotonic()
        if self._cut_off is None:
            self._cut_off = (now, self.step)
            log.warning("troupe: rank %d cannot reach %s at step %d (%s); retrying", self.rank, self.where,
                        self.step, str(error).splitlines()[0][:120] if str(error) else type(error).__name__)
        since, step = self._cut_off
        if now - since > self.peer_timeout and self.waiting_on is not None:
            self._die(f"{self.where} has been unreachable for {now - since:.0f}s, since step {step} "
                      f"(TROUPE_PEER_TIMEOUT={self.peer_timeout:g}s): that host is down or cut off from "
                      "this one (a network partition)")
        try:
            self.store = bounded(self.reconnect, self.store_timeout, "reconnect")
        except ConnectionRefusedError:
            # its host answers, nothing listens: rank 0's process is gone, no need to wait out the timeout
            if self.waiting_on is not None:
                self._die(f"{self.where} refuses connections since step {step}: rank 0, which hosts it, has exited "
                          "(see its report)")
        except Exception:
            pass  # still unreachable: try again next beat
        return False

    def _peers(self) -> tuple[dict[int, tuple[float, int, str]], dict[int, int]]:
        """Other ranks' last heartbeats {rank: (age s, step, waiting on)}, and {rank: step} of those that
        exited. The age is how long this rank has seen the same heartbeat (its own clock)."""
        keys = [f"hb/{r}" for r in range(self.world_size) if r != self.rank]
        now, beating, exited = time.monotonic(), {}, {}
        for key, raw in zip(keys, self._ask(lambda store: store.multi_get(keys))):
            rank, text = int(key.split("/")[1]), raw.decode()
            before = self._seen.get(rank)
            if before is None or before[0] != text:
                self._seen[rank] = (text, now)
            fields = text.split(" ", 2)
            if fields[0] == "exit":
                exited[rank] = int(fields[1])
            else:
                beating[rank] = (now - self._seen[rank][1], int(fields[1]), fields[2])
        self._store_exited = 0 in exited
        self._last_poll = now
        return beating, exited

    def _inspect(self) -> None:
        peers, _ = self._peers()
        if self.refusals is not None:
            refused = bounded(self.refusals, self.store_timeout, "the refusal count")
            if refused > self.refused:
                log.warning("troupe: rank %d refused %d join attempt(s) with a wrong ticket token at step %d "
                            "(%d in all); the job runs on", self.rank, refused - self.refused, self.step, refused)
                self.refused = refused
        silent = {r: (age, step) for r, (age, step, _) in peers.items()
                  if age > self.peer_timeout and r not in self.unwatched}
        for r in sorted(set(silent) & self.expendable - self._forgotten):
            self._forgotten.add(r)
            print(f"troupe: rank {self.rank}: rank {r} sent no heartbeat for {silent[r][0]:.0f}s (last heard at step "
                  f"{silent[r][1]}): the asynchronous cluster goes on without it", file=sys.stderr, flush=True)
        silent = {r: v for r, v in silent.items() if r not in self.expendable}
        if silent:
            since = ", ".join(f"rank {r} last heard at step {step}" for r, (_, step) in sorted(silent.items()))
            self._die(f"rank(s) {sorted(silent)} sent no heartbeat for {max(a for a, _ in silent.values()):.0f}s "
                      f"(TROUPE_PEER_TIMEOUT={self.peer_timeout:g}s; {since}): hung, or its host or link is down")
        if self.waiting_on is None:
            return
        waited = time.monotonic() - self.waiting_since
        if waited > self.stall_seconds and time.monotonic() - self._last_stall_report > self.stall_seconds:
            self._last_stall_report = time.monotonic()
            behind = {r: s for r, (_, s, w) in peers.items() if s < self.step or w == "-"}
            log.warning("troupe stall: rank %d has waited %.0fs at step %d on %s; ranks not there yet: %s",
                        self.rank, waited, self.step, self.waiting_on,
                        ", ".join(f"rank {r} (step {s})" for r, s in sorted(behind.items())) or "none (all waiting)")

    def _culprits(self) -> str:
        """Who failed: ranks that recorded an exception, else ranks whose heartbeat stopped."""
        try:
            failed = [r for r in range(self.world_size)
                      if r != self.rank and self._ask(lambda store: store.check([f"failed/{r}"]))]
            if failed:
                return "; ".join(f"rank {r} raised {self._ask(lambda store: store.get(f'failed/{r}')).decode()}"
                                 for r in failed)
            self._peers()  # the heartbeats now; a killed rank's stays the same, the living keep beating
            time.sleep(1.5 * self.interval)
            beating, exited = self._peers()
            stale = sorted(r for r, (age, _, _) in beating.items() if age > 1.2 * self.interval)
            parts = [f"rank(s) {stale} died (heartbeat stopped)"] if stale else []
            parts += [f"rank {r} exited after step {s}" for r, s in sorted(exited.items())]
            if exited and not stale:
                parts.append("(ranks ran different numbers of steps, or it failed)")
            if not parts:  # everyone is alive: a timeout; name who never reached this collective
                behind = sorted(r for r, (_, s, w) in beating.items() if s < self.step or w == "-")
                if behind:
                    parts.append(f"rank(s) {behind} never arrived (alive, but not in a collective at this step)")
            return " ".join(parts) or "a peer closed its connection"
        except Exception:
            return f"{self.where} is unreachable (rank 0 died, or its host is down or cut off from this one)"

    def _die(self, why: str) -> None:
        print(f"troupe: rank {self.rank} stopping at step {self.step}: {why}", file=sys.stderr, flush=True)
        os._exit(70)  # the main thread may be blocked inside the backend; nothing else can unblock it

    def _excepthook(self, kind, value, tb) -> None:
        if isinstance(value, PeerFailure):
            # Another rank's death, not this rank's bug: its message already names the culprit and the
            # step, and a survivor's traceback through the backend would bury the failing rank's own.
            print(f"troupe: {kind.__name__}: {value}", file=sys.stderr, flush=True)
            return
        if not isinstance(value, KeyboardInterrupt):
            try:
                line = traceback.format_exception_only(kind, value)[-1].strip()
                self._ask(lambda store: store.set(f"failed/{self.rank}", f"{line[:300]} at step {self.step}"))
            except Exception:
                pass  # best effort: the store may be gone
        self._previous_hook(kind, value, tb)


def start(store: dist.Store, rank: int, world_size: int, env: Settings,
          reconnect: Callable[[], dist.Store] | None = None, where: str = "the job's rendezvous",
          refusals: Callable[[], int] | None = None) -> Watchdog | None:
    """This process's watchdog (None for a world of one or with TROUPE_WATCHDOG=0); the World holds it."""
    if world_size > 1 and env.watchdog:
        return Watchdog(store, rank, world_size, env, reconnect, where, refusals)
    return None


@contextmanager
def waiting(dog: Watchdog | None, what: str):
    """Mark a blocking collective; under a watchdog, a failure inside becomes a PeerFailure naming the culprit."""
    if dog is None:
        yield
        return
    with dog.waiting(what):
        try:
            yield
        except PeerFailure:
            raise
        except RuntimeError as e:
            raise dog.explain(e) from e
