"""Distributed Hogwild's synchronisation between worker groups, asynchronous, through master copies.

Every worker group trains on its own copy of the parameters (its co-located servers update
it every step). The master copy of each slice is spread over the groups: the slices server
j of a group owns are cut into G parts (G worker groups), and part k's master copy lives in
the process of server j of group k. Every `sync_freq` steps a group folds what it changed
since its last sync into the master copy of every part and adopts the result::

    master += (cur - last_sync) / G      group_merge "mean" (default)
    master += (cur - last_sync)          group_merge "sum" (SINGA's rule)
    cur = last_sync = master

A thread in each process answers the other groups' requests for the parts it is master of,
so a group never waits for another beyond one message round trip: a slow group does not
hold the others back, and a dead one is forgotten. Its own parts' master copy it updates in
place, the same way. With "mean" and groups that sync in turn, the master copy is the
average of the groups' models (local SGD); "sum" adds every group's full change, G times a
single group's step, which diverges at a learning rate one group trains well with
(docs/clusters.md).

Under ``troupe run --elastic`` a dead group comes back (`troupe.cluster.serving.lives`): its new
life asks every live group for a snapshot (`Op.SNAPSHOT`), takes the first one's replica and
optimizer state, and its own part of the master copy from the group that adopted it last (the
highest version: every change folded in before that adoption is in it; a change whose answer was
lost with the dead master is sent again, since its sender never adopted it).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from troupe.cluster.serving.lives import FixedLives, Lives
from troupe.cluster.serving.mastercopies import MasterCopies
from troupe.cluster.wire.links import Links
from troupe.cluster.wire.messages import HEADER_TAG, PAYLOAD_TAG, Header, MessageError, Op, check, empty_header
from troupe.runtime.comm import Communicator, Handle

log = logging.getLogger(__name__)
T = TypeVar("T")

WATCH_INTERVAL = 0.5
"""Seconds between checks that the peer groups' processes still exist and beat."""

SETTLE_SECONDS = 1.0
"""A new life asks the groups whose links formed within this long of the first one for their state (a
link takes milliseconds; one that has not formed by then is a group dead or starting again itself)."""


@dataclass(frozen=True)
class SyncChannels:
    """Where each kind of group-sync message travels: the serving thread receives the requests (from
    any peer) on `inbox` and sends its answers on `answer`; the training thread sends its requests on
    `ask` and receives their answers on `hear`. `lives`: peers that come back (None: they never do)."""

    inbox: Communicator | Links
    answer: Communicator | Links
    ask: Communicator | Links
    hear: Communicator | Links
    lives: Lives | None = None

    @classmethod
    def pair(cls, requests: Communicator, replies: Communicator) -> SyncChannels:
        """In the job's process group: requests on one channel, their answers on the other (a receive
        from a peer on one channel cannot take the wrong kind of message)."""
        return cls(requests, replies, requests, replies)

    @classmethod
    def relinking(cls, serving: Links, asking: Links, lives: Lives) -> SyncChannels:
        """On links a new life opens again: the peers' requests on the links they dial to this process,
        this process's own on the links it dials to theirs."""
        return cls(serving, serving, asking, asking, lives)


class GroupSync:
    """One worker's side of the group synchronisation: its requests, and the master copy it serves.

    `copies` holds the arithmetic and this group's replica (`MasterCopies`, started here);
    `rank_of(k)` is the global rank of the worker with this worker's index in group k;
    `channels` says where each kind of message travels.
    """

    def __init__(
        self,
        channels: SyncChannels,
        copies: MasterCopies,
        rank_of: Callable[[int], int],
        alive: Callable[[int], bool] = lambda rank: True,
    ):
        self.channels = channels
        self.lives = channels.lives or FixedLives(alive)
        self.copies = copies
        self.group, self.ngroups = copies.group, copies.ngroups
        self.parts, self.sizes = copies.parts, copies.sizes
        """Per group k, the (slice, start, stop) ranges whose master copy group k holds, and their sizes."""
        self.rank = rank_of(self.group)
        self.peers = {k: rank_of(k) for k in range(self.ngroups) if k != self.group}
        self.lock = threading.Lock()
        """Held while the master copy, its version or the set of live peers change (both threads)."""
        self.replica_lock = threading.Lock()
        """Held while the replica changes (the training thread) or is read for a snapshot (the serving thread)."""
        copies.start()
        self.seen = {k: 0 for k in range(self.ngroups)}
        """Version of each master copy this worker last adopted."""
        self.rejected = 0
        self.gone: set[int] = set()
        self.returned = 0
        """Peers' new lives this group synced with again (``troupe run --elastic``)."""
        self._live = set(self.peers.values())
        self._done = threading.Condition(self.lock)
        self._thread: threading.Thread | None = None
        self._watching: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = False
        self.ready = threading.Event()
        """Set once this group has its replica (at once, unless a new life still copies one from the others)."""

    @property
    def master(self) -> torch.Tensor:
        """The master copy of this group's part."""
        return self.copies.master

    # --- the training loop's side ----------------------------------------------------------------

    _active: dict[int, GroupSync] = {}
    """The one GroupSync answering on each pair of sync channels (by the requests channel's id)."""

    def start(self, rejoining: bool = False) -> None:
        """Start answering the other groups (call on every worker before the first sync). `rejoining`: this
        process is a new life of a group that died; its replica comes from the others (`rejoin`)."""
        other = GroupSync._active.setdefault(id(self.channels.inbox), self)
        if other is not self:  # its thread would take this one's requests: the job would hang at a sync
            raise ValueError("Distributed Hogwild: this process already has a DistOpt syncing with the other "
                             "groups; use one DistOpt per process (close() the first before making another)")
        if not rejoining:
            self.ready.set()
        if self.peers:
            self.lives.start(self.peers.values(), on_link=self._linked, on_lost=self._lose, on_back=self._back)
            self._thread = threading.Thread(target=self._serve, name="troupe-group-sync", daemon=True)
            self._thread.start()
            self._watching = threading.Thread(target=self._watch, name="troupe-group-sync-watch", daemon=True)
            self._watching.start()

    def holding(self) -> contextlib.AbstractContextManager:
        """Hold while the training thread changes the replica (a snapshot never sees half a step)."""
        return self.replica_lock

    @torch.no_grad()
    def sync(self) -> None:
        """Fold this group's change since the last sync into every master copy; adopt the results.

        Adopting adds what the master copy brings (`master - cur`, cur as sent), so updates other
        workers make meanwhile to the shared values (in-memory Hogwild) are kept.
        """
        self.lives.awake()
        copies = self.copies
        sends: list[tuple[int, Handle]] = []
        asked: list[int] = []
        lives = {peer: self.lives.life(peer) for peer in self.peers.values()}
        for k, peer in self.peers.items():
            if peer in self.gone or not copies.sizes[k] or not self.lives.ready(peer):
                continue
            delta = copies.request(k)
            header = Header(Op.SYNC, self.group, self.seen[k], self.rank, copies.sizes[k])
            try:
                sends.append((peer, self.channels.ask.isend(header.encode(), peer, tag=HEADER_TAG)))
                sends.append((peer, self.channels.ask.isend(delta, peer, tag=PAYLOAD_TAG)))
                asked.append(k)
            except RuntimeError as e:
                self._lose(peer, str(e), lives[peer])
                copies.forget(k)
        with self.lock, self.replica_lock:
            copies.fold_own()
            self.seen[self.group] = copies.version
        for k in asked:
            got = self._receive(k, lives[self.peers[k]])
            if got is None:
                copies.forget(k)
            else:
                version, value = got
                self.seen[k] = version
                with self.replica_lock:
                    copies.adopt(k, value)
        for peer, h in sends:
            try:
                self._unless_gone(peer, h.wait)
            except RuntimeError as e:  # its process died after it answered, or before
                self._lose(peer, str(e), lives[peer])

    def close(self, timeout: float) -> None:
        """Say stop to every peer, then serve until every peer has stopped or died (at most `timeout` s)."""
        self.lives.finished()
        for peer in self.peers.values():
            if peer not in self.gone and self.lives.ready(peer):
                try:
                    self.channels.ask.send(Header(Op.STOP, self.group, 0, self.rank, 0).encode(), peer,
                                           tag=HEADER_TAG)
                except RuntimeError as e:
                    self._lose(peer, str(e), self.lives.life(peer))
        deadline = time.monotonic() + timeout
        with self._done:
            # Serve until every peer has said stop, died, or (where peers come back) said it has finished: its
            # last Sync is behind it then, even if its Stop has not been read here.
            while self._live and not self.lives.all_finished(sorted(self._live)):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("troupe group sync rank %d: peers %s did not stop within %.0fs",
                                self.rank, sorted(self._live), timeout)
                    break
                self._done.wait(min(left, WATCH_INTERVAL))
            self._closed = True
        self._wake.set()
        if self._watching is not None and self.lives.returns:  # its store calls must end before the interpreter
            self._watching.join(WATCH_INTERVAL * 4)
        self.lives.close()
        if GroupSync._active.get(id(self.channels.inbox)) is self:
            del GroupSync._active[id(self.channels.inbox)]

    def stats(self) -> str:
        merges = self.copies.merges
        mean = sum(merges) / len(merges) if merges else 0.0
        back = f", {self.returned} new life(s) of other groups synced with again" if self.lives.returns else ""
        return (f"{self.copies.version} merges into its master copies (staleness mean {mean:.2f} max {max(merges, default=0)}), "
                f"{self.rejected} message(s) rejected, groups gone without stopping: "
                f"{sorted(self.gone & set(self.peers.values())) or 'none'}{back}")

    # --- internals ---------------------------------------------------------------------------------

    def _receive(self, k: int, life: int) -> tuple[int, Tensor] | None:
        """Peer k's reply, or None once it is gone."""
        return self._unless_gone(self.peers[k], lambda: self._receive_now(k, life))

    def _unless_gone(self, peer: int, call: Callable[[], T]) -> T | None:
        """`call()` (a blocking exchange with `peer`), or None once the peer is gone. A peer cut off
        by the network never closes its connection, and a blocking Gloo call cannot be interrupted
        (a timed wait breaks the connection for good): the call runs in its own thread, abandoned
        when the watch thread declares the peer gone."""
        box: list = []

        def run() -> None:
            try:
                box.append((True, call()))
            except BaseException as e:  # re-raised below
                box.append((False, e))

        thread = threading.Thread(target=run, name="troupe-group-sync-call", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(WATCH_INTERVAL)
            if thread.is_alive() and peer in self.gone:
                return None
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _receive_now(self, k: int, life: int) -> tuple[int, Tensor] | None:
        peer = self.peers[k]
        try:
            raw = empty_header()
            self.channels.hear.recv(raw, peer, tag=HEADER_TAG)
            header = Header.decode(raw)
            check(header, src=peer, expected_length=self.copies.sizes[k], allowed={Op.REPLY, Op.NO_STATE})
            if header.op is Op.NO_STATE:  # a new life still taking its state: nothing adopted, nothing lost
                return None
            value = torch.empty(self.copies.sizes[k], dtype=self.master.dtype)
            self.channels.hear.recv(value, peer, tag=PAYLOAD_TAG)
            return header.version, value
        except MessageError as e:
            raise MessageError(f"group sync reply from rank {peer}: {e}") from None
        except RuntimeError as e:  # Gloo: the peer's process is gone
            self._lose(peer, str(e), life)
            return None

    def _serve(self) -> None:
        while True:
            with self.lock:
                if self._closed or (not self._live and not self.lives.returns):
                    return
            raw = empty_header()
            try:
                src = self.channels.inbox.recv(raw, tag=HEADER_TAG)
            except RuntimeError as e:
                log.warning("troupe group sync rank %d: stopped serving: %s", self.rank, e)
                return
            try:
                self._handle(src, raw)
            except MessageError as e:
                self.rejected += 1
                log.error("troupe group sync rank %d: rejected a message from rank %d: %s", self.rank, src, e)
            except RuntimeError as e:  # the rest of its message never came: its process died
                self._lose(src, str(e))

    def _handle(self, src: int, raw: Tensor) -> None:
        header = Header.decode(raw)
        if src not in self._live:
            if header.op is Op.SYNC and 0 < header.length <= self.copies.sizes[self.group]:
                self.channels.inbox.recv(torch.empty(header.length, dtype=self.master.dtype), src, tag=PAYLOAD_TAG)
            raise MessageError(f"{header.op.name} from rank {src}, which is not a live peer of this master copy")
        expected = self.copies.sizes[self.group]
        check(header, src=src, expected_length=expected, allowed={Op.SYNC, Op.STOP, Op.SNAPSHOT})
        if header.op is Op.STOP:
            self.lives.stopped(src)
            with self._done:
                self._live.discard(src)
                self._done.notify_all()
            return
        if header.op is Op.SNAPSHOT:
            self._snapshot_for(src)
            return
        if header.slice_id != next((k for k, r in self.peers.items() if r == src), None) or header.length != expected:
            if 0 < header.length <= expected:  # consume the payload so the next message lines up
                self.channels.inbox.recv(torch.empty(header.length, dtype=self.master.dtype), src, tag=PAYLOAD_TAG)
            raise MessageError(f"SYNC from rank {src} names group {header.slice_id} and {header.length} elements; "
                               f"expected its group and {expected}")
        delta = torch.empty(expected, dtype=self.master.dtype)
        self.channels.inbox.recv(delta, src, tag=PAYLOAD_TAG)
        if not self.ready.is_set():  # a new life without its part yet: the sender keeps its change for later
            self._answer(src, Header(Op.NO_STATE, self.group, 0, self.rank, 0), None)
            return
        with self.lock:
            version, value = self.copies.fold(delta, header.version)
            reply = Header(Op.REPLY, self.group, version, self.rank, expected)
        try:
            self.channels.answer.send(reply.encode(), src, tag=HEADER_TAG)
            self.channels.answer.send(value, src, tag=PAYLOAD_TAG)
        except RuntimeError as e:
            self._lose(src, str(e))

    def _lose(self, peer: int, why: str, life: int | None = None, *, serving: bool | None = None) -> None:
        """`peer` is gone: this group asks it nothing more until it comes back. `life`: the life whose link
        failed (an older life's failure is old news). `serving` (default: no `life` given, a failure on the
        side that serves it, or its beat): it will not say stop either, so closing does not wait for it;
        where peers come back, a failure of this side's own requests leaves that to the serving side (a new
        life may have dialled in already)."""
        if life is not None and life < self.lives.life(peer):
            return
        if serving is None:
            serving = life is None or not self.lives.returns
        with self._done:
            if serving:
                self._live.discard(peer)
                self._done.notify_all()
            if peer in self.gone:
                return
            self.gone.add(peer)
        then = "until it comes back" if self.lives.returns else "going on without its group"
        print(f"troupe group sync rank {self.rank}: rank {peer} is gone ({why.splitlines()[0] if why else why}); "
              f"{then}", file=sys.stderr, flush=True)

    def _linked(self, peer: int) -> None:
        """A peer's life dialled this process (at the start, or a new life): serve it until it says stop."""
        with self._done:
            self._live.add(peer)

    def _back(self, peer: int) -> None:
        """This process's link to a peer's new life has formed: sync with it again."""
        with self._done:
            if peer in self.gone:
                self.gone.discard(peer)
                self.returned += 1
                print(f"troupe group sync rank {self.rank}: rank {peer} is back (life {self.lives.life(peer)}); "
                      "syncing with its group again", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        while True:
            with self.lock:
                if self._closed or (not self._live and not self.lives.returns):
                    return
                live = sorted(set(self.peers.values()) - self.gone)
            for peer, why in self.lives.look():
                self._lose(peer, why, serving=False)  # its new life's link, if it dialled in already, stays
            for peer in live:
                why = self.lives.lost(peer)
                if why is not None:
                    self._lose(peer, why)
            self._wake.wait(WATCH_INTERVAL)

    # --- a new life of a group that died (troupe run --elastic) ---------------------------------

    def _snapshot_for(self, src: int) -> None:
        """Answer a new life's SNAPSHOT: this replica (last adopted values and optimizer state) and the
        last value adopted of its part, or NO_STATE while this process is a new life itself."""
        if not self.ready.is_set():
            self._answer(src, Header(Op.NO_STATE, self.group, 0, self.rank, 0), None)
            return
        k = next(k for k, r in self.peers.items() if r == src)
        shard = self.copies.shard
        with self.replica_lock:
            state = shard.state_dict()
            state["values"] = {i: v.clone() for i, v in shard.last_sync.items()}  # its unsynced change is its own
            version = self.seen[k]
        buf = io.BytesIO()
        torch.save(state, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        self._answer(src, Header(Op.STATE, self.group, version, self.rank, payload.numel()), payload)

    def _answer(self, src: int, header: Header, payload: Tensor | None) -> None:
        try:
            self.channels.answer.send(header.encode(), src, tag=HEADER_TAG)
            if payload is not None:
                self.channels.answer.send(payload, src, tag=PAYLOAD_TAG)
        except RuntimeError as e:
            self._lose(src, str(e))

    def rejoin(self, wait: float) -> bool:
        """A new life of this group: take a live group's replica and the freshest value of this group's part
        of the master copy (see the module's docstring). Waits up to `wait` s for the links to the groups
        that beat. False when no group had state to give: every other group has finished (this group's
        work is done), or is a new life too (raises: the job's state is gone)."""
        start = time.monotonic()
        peers = list(self.peers.values())
        first: float | None = None  # when the first link formed: the others get SETTLE_SECONDS more
        while not all(self.lives.ready(p) or p in self.gone for p in peers):
            now = time.monotonic()
            if first is None and any(self.lives.ready(p) for p in peers):
                first = now
            if now - start > wait or (first is not None and now - first > SETTLE_SECONDS):
                break
            time.sleep(0.02)
        answers: list[tuple[int, int, bytes]] = []
        for peer in peers:
            if peer in self.gone or not self.lives.ready(peer):
                continue
            life = self.lives.life(peer)
            try:
                self.channels.ask.send(Header(Op.SNAPSHOT, self.group, 0, self.rank, 0).encode(), peer,
                                       tag=HEADER_TAG)
            except RuntimeError as e:
                self._lose(peer, str(e), life)
                continue
            got = self._unless_gone(peer, lambda: self._state_from(peer, life))
            if got is not None:
                answers.append((peer, *got))
        if not answers:
            if self.lives.all_finished(peers):
                return False
            raise RuntimeError(f"troupe group sync rank {self.rank}: this group started again, but no other group "
                               "had state to give (each is gone or starting again itself): the job's model is lost")
        self._take(answers)
        self.ready.set()
        return True

    def _state_from(self, peer: int, life: int) -> tuple[int, bytes] | None:
        try:
            raw = empty_header()
            self.channels.hear.recv(raw, peer, tag=HEADER_TAG)
            header = Header.decode(raw)
            check(header, src=peer, expected_length=header.length, allowed={Op.STATE, Op.NO_STATE})
            if header.op is Op.NO_STATE:
                return None
            payload = torch.empty(header.length, dtype=torch.uint8)
            self.channels.hear.recv(payload, peer, tag=PAYLOAD_TAG)
            return header.version, payload.numpy().tobytes()
        except MessageError as e:
            raise MessageError(f"group sync snapshot from rank {peer}: {e}") from None
        except RuntimeError as e:
            self._lose(peer, str(e), life)
            return None

    def _take(self, answers: list[tuple[int, int, bytes]]) -> None:
        """The first answer's replica and optimizer state; this group's part from the highest version."""
        states: list[tuple[int, int, Any]] = [(peer, version, torch.load(io.BytesIO(blob), weights_only=True))
                                              for peer, version, blob in answers]
        copies = self.copies
        source, version, freshest = max(states, key=lambda a: a[1])
        part = copies.gather(self.group, freshest["values"])
        with self.lock, self.replica_lock:
            copies.shard.load_state_dict(states[0][2])
            copies.settle(self.group, part)
            copies.master = part.clone()
            copies.version = version
            self.seen[self.group] = version
        print(f"troupe group sync rank {self.rank}: took the replica of rank {states[0][0]} and this group's part "
              f"of the master copy at version {version} (rank {source})", file=sys.stderr, flush=True)
