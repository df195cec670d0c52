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
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager

from troupe.runtime.settings import Settings
import torch.distributed as dist

log = logging.getLogger("troupe")


class PeerFailure(RuntimeError):
    """A collective failed because another rank died, raised, or stopped responding."""


class Watchdog:
    """Heartbeat thread plus the bookkeeping the main thread updates (step, current wait)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, env: Settings):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval, self.stall_seconds, self.peer_timeout = env.heartbeat, env.stall_seconds, env.peer_timeout
        self.step = 0
        self.waiting_on: str | None = None
        self.waiting_since = 0.0
        self._last_stall_report = 0.0
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="troupe-watchdog", daemon=True)
        self._thread.start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self.stop)

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
        """Stop beating and tell the peers this rank exited (so its silence is not taken for a hang)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)
        sys.excepthook = self._previous_hook
        try:
            self.store.set(f"hb/{self.rank}", f"exit {self.step}")
        except Exception:
            pass  # rank 0 (the store) already left

    # --- heartbeat thread ------------------------------------------------------------------

    def _beat(self) -> None:
        self.store.set(f"hb/{self.rank}", f"{time.time():.3f} {self.step} {self.waiting_on or '-'}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                self._inspect()
            except Exception:
                # The store (rank 0) is gone: at the end of a job that is normal, and mid-job the
                # next collective fails and explain() says so. Either way, stop beating.
                return

    def _peers(self) -> tuple[dict[int, tuple[float, int, str]], dict[int, int]]:
        """Other ranks' last heartbeats {rank: (age s, step, waiting on)}, and {rank: step} of those that exited."""
        keys = [f"hb/{r}" for r in range(self.world_size) if r != self.rank]
        now, beating, exited = time.time(), {}, {}
        for key, raw in zip(keys, self.store.multi_get(keys)):
            rank, fields = int(key.split("/")[1]), raw.decode().split(" ", 2)
            if fields[0] == "exit":
                exited[rank] = int(fields[1])
            else:
                beating[rank] = (now - float(fields[0]), int(fields[1]), fields[2])
        return beating, exited

    def _inspect(self) -> None:
        peers, _ = self._peers()
        silent = {r: age for r, (age, _, _) in peers.items() if age > self.peer_timeout}
        if silent:
            self._die(f"rank(s) {sorted(silent)} sent no heartbeat for {max(silent.values()):.0f}s "
                      f"(TROUPE_PEER_TIMEOUT={self.peer_timeout:g}s): hung or unreachable")
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
            failed = [r for r in range(self.world_size) if r != self.rank and self.store.check([f"failed/{r}"])]
            if failed:
                return "; ".join(f"rank {r} raised {self.store.get(f'failed/{r}').decode()}" for r in failed)
            time.sleep(1.5 * self.interval)  # a killed rank's heartbeat goes stale, the living keep beating
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
            return "rank 0, which hosts the job's rendezvous, is unreachable (it probably died)"

    def _die(self, why: str) -> None:
        print(f"troupe: rank {self.rank} stopping at step {self.step}: {why}", file=sys.stderr, flush=True)
        os._exit(70)  # the main thread may be blocked inside the backend; nothing else can unblock it

    def _excepthook(self, kind, value, tb) -> None:
        if not isinstance(value, (PeerFailure, KeyboardInterrupt)):
            try:
                line = traceback.format_exception_only(kind, value)[-1].strip()
                self.store.set(f"failed/{self.rank}", f"{line[:300]} at step {self.step}")
            except Exception:
                pass  # best effort: the store may be gone
        self._previous_hook(kind, value, tb)


def start(store: dist.Store, rank: int, world_size: int, env: Settings) -> Watchdog | None:
    """This process's watchdog (None for a world of one or with TROUPE_WATCHDOG=0); the World holds it."""
    if world_size > 1 and env.watchdog:
        return Watchdog(store, rank, world_size, env)
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
