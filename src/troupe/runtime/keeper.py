"""An elastic parameter-server job's launcher side (runtime/rejoin.py has the workers'): `Keeper`, the job's
store and what the nodes' launchers tell each other through it. Nothing to decide: no quorum (an elastic job
of worker groups has its lighthouse, runtime/lighthouse.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from troupe.runtime import liveness
from troupe.runtime.quorum import read_refusal
from troupe.runtime.ticket import Ticket


class Keeper:
    """Elastic parameter servers' launcher side (runtime/rejoin.py has the workers'): node 0's hosts the
    job's store (so the store outlives any rank, and a restarted worker finds the job there), another
    node's connects to it; each takes its supervisor's word on its own processes (nothing to decide: no
    quorum). Through the store the nodes' launchers tell each other that a node has ended (`end`), with
    its exit code: a failed node ends the job on every node (`ended`), and node 0 keeps the store until
    every node has ended (`wait_for_nodes`)."""

    def __init__(self, ticket: Ticket, ranks: int, *, host: bool = True, timeout: float = 30.0):
        import torch.distributed as dist

        from troupe.runtime.launch import open_store, token_digest_record

        self._base = open_store(ticket, host, timeout)
        if host:  # another node's launcher only reads and counts: its ranks check the token as they join
            self._base.set("troupe/digest", token_digest_record(ticket.token))
        self.store = dist.PrefixStore(f"troupe/{ticket.token}/", self._base)
        self.ranks = ranks
        self._formed = False
        self._beaten = self._looked = float("-inf")
        self._beats: liveness.Silence | None = None  # the separate servers' beats, from the first look

    def refusal(self, rank: int) -> str | None:
        """`Lighthouse.refusal`: why `rank` refused the job, or None."""
        try:
            return read_refusal(self.store, rank)
        except (RuntimeError, ConnectionError, OSError):
            return None

    @property
    def formed_once(self) -> bool:
        """Every rank of the job's start has joined (the launcher then starts its spares)."""
        if not self._formed:
            self._formed = self.store.add("joined", 0) >= self.ranks
        return self._formed

    def lost(self, rank: int, *, finished: bool = False) -> None:
        pass  # the servers see a worker's link fail themselves

    def restarted(self, rank: int) -> None:
        pass  # it dials its servers when it is ready

    def server_gone(self, rank: int) -> None:
        """Separate server `rank` died and is not restarted (its workers fail over to another server group):
        say so in the store, for every node and for a worker that starts later."""
        from troupe.runtime.rejoin import gone_key

        try:
            self.store.set(gone_key(rank), "1")
        except (RuntimeError, ConnectionError, OSError):
            pass

    def gone(self, ranks: Iterable[int]) -> set[int]:
        """Which of these servers died, on any node."""
        from troupe.runtime.rejoin import gone_key

        return {rank for rank in ranks if self.store.check([gone_key(rank)])}

    def frozen(self, ranks: list[int], evict_after: float) -> dict[int, float]:
        """Of these processes (separate servers whose workers fail over), those whose beat has stood still
        for `evict_after` seconds: {rank: seconds}. Looked at every BEAT_SECONDS at most (their counters in one
        read). A process not yet beating (still starting) or leaving (`closing_key`) is never frozen."""
        from troupe.runtime.rejoin import closing_key

        now = time.monotonic()
        if now - self._looked < liveness.BEAT_SECONDS:
            return {}
        self._looked = now
        if self._beats is None:
            self._beats = liveness.Silence(self.store)
        try:
            silent = self._beats.look(ranks)
            return {rank: still for rank, still in silent.items() if still >= evict_after
                    and self._beats.started(rank) and not self.store.check([closing_key(rank)])}
        except (RuntimeError, ConnectionError, OSError):  # node 0's store is gone: the job is over
            return {}

    def beat(self, node: int) -> None:
        """This node's launcher is alive (at most once a second; node 0 reads it in `wait_for_nodes`). Its
        counter is `liveness.key`'s, beaten from the launcher's loop, not by a `liveness.Beat` thread: a launcher
        whose loop is stuck is not looking after its ranks, and node 0 should count it gone."""
        now = time.monotonic()
        if now - self._beaten >= 1.0:
            self._beaten = now
            try:
                self.store.add(liveness.key(f"node/{node}"), 1)
            except (RuntimeError, ConnectionError, OSError):
                pass

    def end(self, node: int, code: int) -> None:
        """This node's ranks are done (`code` 0) or this node stopped the job (its code)."""
        try:
            if code:
                self.store.compare_set("failed", "", str(code))
            self.store.set(f"node/{node}/ended", str(code))
        except (RuntimeError, ConnectionError, OSError):
            pass  # node 0's store is gone: the job is over there anyway

    def ended(self) -> int | None:
        """The exit code another node stopped the job with, or None while nobody has."""
        try:
            return int(self.store.get("failed")) if self.store.check(["failed"]) else None
        except (RuntimeError, ConnectionError, OSError, ValueError):
            return None

    def wait_for_nodes(self, nodes: int, silence: float, say: Callable[[str], None]) -> None:
        """Node 0: keep the store up until every other node's launcher has ended (its ranks may still train,
        or dial their servers again) or has not beaten for `silence` seconds (it is gone)."""
        waiting, beats = [f"node/{n}" for n in range(1, nodes)], liveness.Silence(self.store)
        while waiting:
            for who, still in beats.look(waiting).items():
                n = int(who.split("/")[1])
                if self.store.check([f"node/{n}/ended"]):
                    waiting.remove(who)
                elif still > silence:
                    say(f"troupe run: node {n}'s launcher has said nothing for {silence:.0f} s; the job's store "
                        "(this node's) closes")
                    waiting.remove(who)
            time.sleep(0.1)

    def stop(self) -> None:
        pass  # the store goes with this process
