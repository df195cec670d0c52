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
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from troupe.cluster.serving.mastercopies import MasterCopies
from troupe.cluster.wire.messages import HEADER_TAG, PAYLOAD_TAG, Header, MessageError, Op, check, empty_header
from troupe.runtime.comm import Communicator, Handle

log = logging.getLogger(__name__)
T = TypeVar("T")

WATCH_INTERVAL = 0.5
"""Seconds between checks that the peer groups' processes still exist and beat."""


class GroupSync:
    """One worker's side of the group synchronisation: its requests, and the master copy it serves.

    `copies` holds the arithmetic and this group's replica (`MasterCopies`, started here);
    `rank_of(k)` is the global rank of the worker with this worker's index in group k;
    requests travel on `requests` (this process's thread only receives there), replies on
    `replies` (only the thread sends there), so each direction has its own channel.
    """

    def __init__(
        self,
        requests: Communicator,
        replies: Communicator,
        copies: MasterCopies,
        rank_of: Callable[[int], int],
        alive: Callable[[int], bool] = lambda rank: True,
    ):
        self.requests, self.replies = requests, replies
        self.copies = copies
        self.group, self.ngroups = copies.group, copies.ngroups
        self.parts, self.sizes = copies.parts, copies.sizes
        """Per group k, the (slice, start, stop) ranges whose master copy group k holds, and their sizes."""
        self.rank = rank_of(self.group)
        self.peers = {k: rank_of(k) for k in range(self.ngroups) if k != self.group}
        self.alive = alive
        self.lock = threading.Lock()
        """Held while the master copy, its version or the set of live peers change (both threads)."""
        copies.start()
        self.seen = {k: 0 for k in range(self.ngroups)}
        """Version of each master copy this worker last adopted."""
        self.rejected = 0
        self.gone: set[int] = set()
        self._live = set(self.peers.values())
        self._done = threading.Condition(self.lock)
        self._thread: threading.Thread | None = None

    @property
    def master(self) -> torch.Tensor:
        """The master copy of this group's part."""
        return self.copies.master

    # --- the training loop's side ----------------------------------------------------------------

    _active: dict[int, GroupSync] = {}
    """The one GroupSync answering on each pair of sync channels (by the requests channel's id)."""

    def start(self) -> None:
        """Start answering the other groups (call on every worker before the first sync)."""
        other = GroupSync._active.setdefault(id(self.requests), self)
        if other is not self:  # its thread would take this one's requests: the job would hang at a sync
            raise ValueError("Distributed Hogwild: this process already has a DistOpt syncing with the other "
                             "groups; use one DistOpt per process (close() the first before making another)")
        if self.peers:
            self._thread = threading.Thread(target=self._serve, name="troupe-group-sync", daemon=True)
            self._thread.start()
            threading.Thread(target=self._watch, name="troupe-group-sync-watch", daemon=True).start()

    @torch.no_grad()
    def sync(self) -> None:
        """Fold this group's change since the last sync into every master copy; adopt the results.

        Adopting adds what the master copy brings (`master - cur`, cur as sent), so updates other
        workers make meanwhile to the shared values (in-memory Hogwild) are kept.
        """
        copies = self.copies
        sends: list[tuple[int, Handle]] = []
        asked: list[int] = []
        for k, peer in self.peers.items():
            if peer in self.gone or not copies.sizes[k]:
                continue
            delta = copies.request(k)
            header = Header(Op.SYNC, self.group, self.seen[k], self.rank, copies.sizes[k])
            try:
                sends.append((peer, self.requests.isend(header.encode(), peer, tag=HEADER_TAG)))
                sends.append((peer, self.requests.isend(delta, peer, tag=PAYLOAD_TAG)))
                asked.append(k)
            except RuntimeError as e:
                self._lose(peer, str(e))
                copies.forget(k)
        with self.lock:
            copies.fold_own()
            self.seen[self.group] = copies.version
        for k in asked:
            got = self._receive(k)
            if got is None:
                copies.forget(k)
            else:
                version, value = got
                self.seen[k] = version
                copies.adopt(k, value)
        for peer, h in sends:
            try:
                self._unless_gone(peer, h.wait)
            except RuntimeError as e:
                log.warning("troupe group sync: a request was not delivered: %s", e)

    def close(self, timeout: float) -> None:
        """Say stop to every peer, then serve until every peer has stopped or died (at most `timeout` s)."""
        for peer in self.peers.values():
            if peer not in self.gone:
                try:
                    self.requests.send(Header(Op.STOP, self.group, 0, self.rank, 0).encode(), peer, tag=HEADER_TAG)
                except RuntimeError as e:
                    self._lose(peer, str(e))
        with self._done:
            if not self._done.wait_for(lambda: not self._live, timeout=timeout):
                log.warning("troupe group sync rank %d: peers %s did not stop within %.0fs",
                            self.rank, sorted(self._live), timeout)
        if GroupSync._active.get(id(self.requests)) is self:
            del GroupSync._active[id(self.requests)]

    def stats(self) -> str:
        merges = self.copies.merges
        mean = sum(merges) / len(merges) if merges else 0.0
        return (f"{self.copies.version} merges into its master copies (staleness mean {mean:.2f} max {max(merges, default=0)}), "
                f"{self.rejected} message(s) rejected, groups gone without stopping: "
                f"{sorted(self.gone & set(self.peers.values())) or 'none'}")

    # --- internals ---------------------------------------------------------------------------------

    def _receive(self, k: int) -> tuple[int, Tensor] | None:
        """Peer k's reply, or None once it is gone."""
        return self._unless_gone(self.peers[k], lambda: self._receive_now(k))

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

    def _receive_now(self, k: int) -> tuple[int, Tensor] | None:
        peer = self.peers[k]
        try:
            raw = empty_header()
            self.replies.recv(raw, peer, tag=HEADER_TAG)
            header = Header.decode(raw)
            check(header, src=peer, expected_length=self.copies.sizes[k], allowed={Op.REPLY})
            value = torch.empty(self.copies.sizes[k], dtype=self.master.dtype)
            self.replies.recv(value, peer, tag=PAYLOAD_TAG)
            return header.version, value
        except MessageError as e:
            raise MessageError(f"group sync reply from rank {peer}: {e}") from None
        except RuntimeError as e:  # Gloo: the peer's process is gone
            self._lose(peer, str(e))
            return None

    def _serve(self) -> None:
        while True:
            with self.lock:
                if not self._live:
                    return
            raw = empty_header()
            try:
                src = self.requests.recv(raw, tag=HEADER_TAG)
            except RuntimeError as e:
                log.warning("troupe group sync rank %d: stopped serving: %s", self.rank, e)
                return
            try:
                self._handle(src, raw)
            except MessageError as e:
                self.rejected += 1
                log.error("troupe group sync rank %d: rejected a message from rank %d: %s", self.rank, src, e)

    def _handle(self, src: int, raw: Tensor) -> None:
        header = Header.decode(raw)
        if src not in self._live:
            raise MessageError(f"{header.op.name} from rank {src}, which is not a live peer of this master copy")
        expected = self.copies.sizes[self.group]
        check(header, src=src, expected_length=expected, allowed={Op.SYNC, Op.STOP})
        if header.op is Op.STOP:
            with self._done:
                self._live.discard(src)
                self._done.notify_all()
            return
        if header.slice_id != next((k for k, r in self.peers.items() if r == src), None) or header.length != expected:
            if 0 < header.length <= expected:  # consume the payload so the next message lines up
                self.requests.recv(torch.empty(header.length, dtype=self.master.dtype), src, tag=PAYLOAD_TAG)
            raise MessageError(f"SYNC from rank {src} names group {header.slice_id} and {header.length} elements; "
                               f"expected its group and {expected}")
        delta = torch.empty(expected, dtype=self.master.dtype)
        self.requests.recv(delta, src, tag=PAYLOAD_TAG)
        with self.lock:
            version, value = self.copies.fold(delta, header.version)
            reply = Header(Op.REPLY, self.group, version, self.rank, expected)
        try:
            self.replies.send(reply.encode(), src, tag=HEADER_TAG)
            self.replies.send(value, src, tag=PAYLOAD_TAG)
        except RuntimeError as e:
            self._lose(src, str(e))

    def _lose(self, peer: int, why: str) -> None:
        with self._done:
            if peer in self.gone:
                return
            self.gone.add(peer)
            self._live.discard(peer)
            self._done.notify_all()
        print(f"troupe group sync rank {self.rank}: rank {peer} is gone ({why.splitlines()[0] if why else why}); "
              "going on without its group", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        while True:
            with self.lock:
                live = sorted(self._live)
            if not live:
                return
            for peer in live:
                if not self.alive(peer):
                    self._lose(peer, "its process ended or its heartbeat stopped")
            threading.Event().wait(WATCH_INTERVAL)
