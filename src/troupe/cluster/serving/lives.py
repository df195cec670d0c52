"""Who of Distributed Hogwild's other groups is there to sync with, and how a group that died comes back.

`GroupSync` asks its `Lives` four things: is a peer gone (`lost`), may it be asked now (`ready`), what
changed since the last look (`look`, every WATCH_INTERVAL), and has every peer finished (`all_finished`).

* `FixedLives`: the job's processes never come back (a job without ``--elastic``). A peer is gone once
  its process has ended or its heartbeat went silent; the requests travel in the job's process group.
* `Lives`: ``troupe run --elastic --framework hogwild``. A dead group's process is started again by its
  launcher, as a new life (its incarnation). Each group's requests travel on links a new life can open
  again (`troupe.cluster.wire.links`): every process *serves* a link to each peer (the peer's requests
  to its master copy) and *asks* on a link it dials to each peer. A life announces itself under
  ``hogwild/life/<rank>``; the others see it at their next look, count the older life gone, and dial
  the new one; once their link forms the peer is back (`on_back`). A peer whose beat (its
  `Rejoining` beat thread) stalls for ``evict_after`` seconds is gone as well (frozen, or on a dead
  host): a frozen process that wakes finds its own looks that far apart and leaves with the rejoin
  code, to be started again as a new life (the others went on without it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable

import torch.distributed as dist

from troupe.cluster.wire.links import Links
from troupe.cluster.wire.messages import empty_header
from troupe.runtime.quorum import REJOIN_EXIT
from troupe.runtime import liveness

FORM_SECONDS = 5.0
"""How long a link to a peer's life may take to form (milliseconds when both ends live; a life that died
while it formed fails it, and a life still there is dialled again)."""


def life_key(rank: int) -> str:
    return f"hogwild/life/{rank}"


def done_key(rank: int) -> str:
    return f"hogwild/done/{rank}"


class FixedLives:
    """Peers that never come back: gone once `alive(rank)` is False."""

    returns = False

    def __init__(self, alive: Callable[[int], bool]):
        self.alive = alive

    def start(self, peers: Iterable[int], on_link: Callable[[int], None], on_lost: Callable[[int, str], None],
              on_back: Callable[[int], None]) -> None:
        pass

    def lost(self, peer: int) -> str | None:
        return None if self.alive(peer) else "its process ended or its heartbeat stopped"

    def look(self) -> list[tuple[int, str]]:
        return []

    def awake(self) -> None:
        pass

    def stopped(self, peer: int) -> None:
        pass

    def ready(self, peer: int) -> bool:
        return True

    def life(self, peer: int) -> int:
        return 0

    def finished(self) -> None:
        pass

    def all_finished(self, peers: Iterable[int]) -> bool:
        return False

    def close(self) -> None:
        pass


class Lives:
    """Peers that die and come back as new lives (`troupe run --elastic`); see the module's docstring.

    `serving` takes the links the peers dial to this life, `asking` dials theirs; `connect()` makes a
    store connection of this object's own (its looks run in the watch thread).
    """

    returns = True

    def __init__(self, serving: Links, asking: Links, connect: Callable[[], dist.Store], rank: int,
                 incarnation: int, evict_after: float):
        self.serving, self.asking = serving, asking
        self.connect = connect
        self.rank, self.incarnation, self.evict_after = rank, incarnation, evict_after
        self.store: dist.Store | None = None
        self._store: dist.Store | None = None
        self.lives: dict[int, int] = {}
        """Each peer's life this process last dialled."""
        self.peers: list[int] = []
        self.beats: liveness.Silence | None = None
        """How long each peer's beat has stood still (the watch thread's store)."""
        self.attempts: dict[tuple[int, int], int] = {}
        """Per (peer, its life): the last attempt at a link to it."""
        self.retry: set[int] = set()
        """Peers whose current life's link did not form in time (dialled again at the next look)."""
        self.on_back: Callable[[int], None] = lambda peer: None
        self._last_look = time.monotonic()

    def start(self, peers: Iterable[int], on_link: Callable[[int], None], on_lost: Callable[[int, str], None],
              on_back: Callable[[int], None]) -> None:
        """Announce this life, take the peers' links to it, and dial every peer's life that has announced itself."""
        self.store = self.connect()
        self._last_look = time.monotonic()
        self.on_back = on_back
        peers = sorted(peers)
        self.serving.on_link, self.serving.on_lost = on_link, on_lost
        self.serving.listen(peers, empty_header, self.incarnation)
        self.store.set(life_key(self.rank), str(self.incarnation))
        self.peers = peers
        self.beats = liveness.Silence(self.store)
        self.beats.read(peers)  # counted from now
        for peer in peers:
            life = self._life(peer)
            if life is not None:
                self._dial(peer, life)

    def _life(self, peer: int) -> int | None:
        key = life_key(peer)
        return int(self.store.get(key)) if self.store.check([key]) else None

    def _dial(self, peer: int, life: int) -> None:
        attempt = self.attempts.get((peer, life), -1) + 1
        self.attempts[(peer, life)] = attempt
        self.lives[peer] = life
        self.retry.discard(peer)
        self.asking.dial_later(peer, self.incarnation, life, attempt, on_ready=self.on_back, on_failed=self._failed)

    def _failed(self, peer: int, life: int) -> None:
        """The link to `peer`'s `life` did not form in time: dial it again at the next look if it is still its life."""
        if self.lives.get(peer) == life:
            self.retry.add(peer)

    def lost(self, peer: int) -> str | None:
        """Why `peer`'s life counts as gone (its beat stalled), or None."""
        still = self.beats.look([peer])[peer]
        if still > self.evict_after:
            return f"its beat stopped {still:.1f} s ago (frozen, or its host is gone)"
        return None

    def look(self) -> list[tuple[int, str]]:
        """Leave if this process was frozen past the bound; dial every peer's new life. Returns the peers
        whose older life is gone by it (a new one announced itself), with why."""
        self.awake()
        self._last_look = time.monotonic()
        gone = []
        for peer in self.peers:
            life, known = self._life(peer), self.lives.get(peer)
            if life is None:
                continue
            if known is None or life > known:
                if known is not None:
                    gone.append((peer, f"it started again (life {life})"))
                self._dial(peer, life)
            elif peer in self.retry and life == known:
                self._dial(peer, life)
        return gone

    def awake(self) -> None:
        """Leave (with the rejoin code) if this process's looks were `evict_after` apart: it was frozen, and
        the other groups count it gone. Called by the watch thread and before each sync (whichever thread
        wakes first)."""
        gap = time.monotonic() - self._last_look
        if gap > self.evict_after:
            print(f"troupe group sync rank {self.rank}: this process was stopped for {gap:.1f} s (more than "
                  f"evict_after {self.evict_after:g} s): the other groups went on without it; starting again "
                  "to rejoin them", file=sys.stderr, flush=True)
            os._exit(REJOIN_EXIT)  # its launcher starts it again at once (not a failure: no restart spent)

    def stopped(self, peer: int) -> None:
        """`peer` said it is done (its Stop is being read): its link to this process carries nothing more."""
        self.serving.retire(peer)

    def ready(self, peer: int) -> bool:
        return self.asking.connected(peer)

    def life(self, peer: int) -> int:
        """The life of `peer` this process knows of last (a failure of an older one's link is old news)."""
        return self.lives.get(peer, 0)

    def finished(self) -> None:
        """Say that this group has finished training (a life started later finds nobody to copy from; the
        others stop serving it)."""
        self._own_store().set(done_key(self.rank), "1")

    def all_finished(self, peers: Iterable[int]) -> bool:
        store = self._own_store()
        return all(store.check([done_key(p)]) for p in peers)

    def _own_store(self) -> dist.Store:
        """The training thread's connection to the store (the watch thread has its own)."""
        if self._store is None:
            self._store = self.connect()
        return self._store

    def close(self) -> None:
        self.serving.close(wait=True)
        self.asking.close(wait=True)
