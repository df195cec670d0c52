"""Separate server groups synchronise through master copies (SINGA: "every server group synchronizes
with neighboring server groups periodically").

With ``server_worker_separate`` and G = ``nserver_groups`` > 1 every server group holds a replica of
the parameters, updated by its own worker groups. The master copy of each part is spread as
Distributed Hogwild's is, with the same arithmetic (`troupe.cluster.serving.mastercopies`): the
slices server j holds are cut into G parts, and part k's master copy lives with server j of server
group k. Every ``sync_freq`` group updates of its whole shard (the shard's slice updates grow by
``sync_freq`` times its number of slices) a server folds its own part into its master copy and sends ``cur - last_sync`` of every
other part to that part's master (Merge), which folds it in and answers with its value (Merged).
The server adopts it, keeping the updates its workers made meanwhile::

    master += (sent - last_sync) / G      group_merge "mean" (default; "sum": the full change)
    cur = master + (cur - sent)           sent: the part's value when the Merge left
    last_sync = master

Why a channel of their own (a process group of the servers, as groupsync has) and a receiving thread
per neighbour, not more messages in the server's loop: the first version handled them in that loop,
which is simpler, but Gloo's receive from any rank fails for good once one peer's connection is reset,
and a server killed with a neighbour's Merge unread in its socket resets it: the survivor could then
serve its own workers no more (seen in 2 of 6 runs of the dead-neighbour test). On a channel of their
own, received from one neighbour at a time, such a reset breaks only the dead neighbour's thread: the
workers' loop sees a clean close, as it does for a worker that dies, and the other neighbours keep
syncing (under `troupe run --elastic` a dead server's workers fail over, and three server groups or
more go on with two). The threads change the shard under the server's lock, and never block on a
neighbour's answer: Merges and answers leave with isend, and an answer is one more message a
thread receives (two servers that send each other a Merge at the same moment each find the other's).
A server has at most one Merge per part in flight; a sync due meanwhile skips that part (the change
is carried by the next one). A neighbour whose receive fails is forgotten; it ends its thread.

The end: once every worker of its groups has stopped, a server folds its own part in, sends each
part's master a last Merge (when the one in flight has been answered) and then Finished, and goes on
answering. A master that has finished and heard Finished from every neighbour has folded in every
group's last change: it sets its own part to the master copy and sends it to every neighbour
(Final), which set the part to it. So when every server group has finished, they hold the same
values, and a server's checkpoint (``ps-server-<rank>.pt``) holds them with ``last_sync`` equal to
them. A neighbour that dies is forgotten with a logged line: its master copies go with it, and the
survivors keep their own values for those parts.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

from troupe.cluster.serving.mastercopies import MasterCopies
from troupe.cluster.wire.links import reason
from troupe.cluster.wire.messages import HEADER_TAG, PAYLOAD_TAG, Header, MessageError, Op, check, empty_header
from troupe.runtime.comm import Communicator, Handle

log = logging.getLogger(__name__)

WATCH_INTERVAL = 0.5
"""Seconds between checks that the peers a closing server waits for still exist."""


class ServerSync:
    """A server's messages with its neighbours (server j of every other server group).

    `comm` is the servers' own channel; `peers` maps each other server group to the rank of its server
    with this server's index. The server calls `start` before serving, `progress` after every worker
    message, and at the end `wait_done` and `close`, all with `lock` held; a thread receives the
    neighbours' messages (`handle`) under the same lock.
    """

    def __init__(self, comm: Communicator, copies: MasterCopies, peers: dict[int, int], sync_freq: int,
                 own_workers: set[int], rank: int | None = None):
        self.comm, self.copies, self.shard = comm, copies, copies.shard
        self.rank = comm.rank if rank is None else rank
        self.lock = threading.Lock()
        """The server's lock: held while the shard or this state changes."""
        self._cv = threading.Condition(self.lock)
        self.alive: Callable[[int], bool] = lambda rank: True
        self.peers = dict(peers)
        self.group_of = {rank: k for k, rank in peers.items()}
        self.own_workers = set(own_workers)
        """The workers of this server's worker groups: the server finishes when all have stopped."""
        self.every = sync_freq * max(1, len(self.shard.slices))
        self.next_at = self.every
        self.syncs = 0
        self.finishing = False
        self.finals_sent = False
        self.told: set[int] = set()
        """Peers sent our last Merge and Finished."""
        self.finished: set[int] = set()
        """Peers that said Finished."""
        self.awaiting: set[int] = {r for k, r in peers.items() if copies.sizes[k]}
        """Peers whose Final has not come (a peer master of an empty part sends none)."""
        self.gone: set[int] = set()
        self.rejected = 0
        self._deferred: list[tuple[int, Header, Tensor]] = []  # Merges that came before our initial values
        self._sends: dict[int, deque[tuple[int, Handle, Tensor]]] = {r: deque() for r in peers.values()}
        """Per peer, the sends not yet known to be taken: (sequence number, handle, tensor kept alive)."""
        self._sent = {r: 0 for r in peers.values()}  # sends made to each peer so far
        # A peer has taken every send before the mark once it answers our Merge (sends up to that Merge),
        # or once it Merges again (sends up to our answer to its last Merge).
        self._merge_mark = {r: 0 for r in peers.values()}
        self._answer_mark = {r: 0 for r in peers.values()}

    # --- the server loop's side ---------------------------------------------------------------------

    def start(self, alive: Callable[[int], bool]) -> None:
        """Start receiving the neighbours' messages; `alive(rank)` tells a dead neighbour from a slow one."""
        self.alive = alive
        for peer in sorted(self.peers.values()):
            threading.Thread(target=self._serve, args=(peer,), name=f"troupe-server-sync-{peer}", daemon=True).start()

    def wait_done(self) -> None:
        """Wait (lock held; released while waiting) until every server group has finished or died."""
        while not self.done():
            self._cv.wait(WATCH_INTERVAL)
            for peer in self.watching():
                if not self.alive(peer):
                    self.lose(peer, "its process ended or its heartbeat stopped")

    def progress(self, live: set[int]) -> None:
        """After each message: start once the values are in, sync when due, finish when the workers stopped."""
        if self.copies.master is None:
            if len(self.shard.initialised) < len(self.shard.slices):  # a slice's initial value has not come
                if not self.finishing and not (self.own_workers & live):
                    # Our workers left before every initial value came (the job failed at its start):
                    # nothing to sync. End; the neighbours forget this server when its process ends.
                    self.finishing = self.finals_sent = True
                    self.awaiting.clear()
                return
            self.copies.start()
            for src, header, delta in self._deferred:
                self._answer(src, header, delta)
            self._deferred.clear()
        if not self.finishing and not (self.own_workers & live):
            self._finish()
        elif not self.finishing and self.shard.updates >= self.next_at:
            self.next_at = self.shard.updates + self.every
            self.syncs += 1
            self.copies.fold_own()
            for k, peer in self.peers.items():
                if peer not in self.gone and self.copies.sizes[k] and k not in self.copies.sent:
                    self._merge(k)

    def done(self) -> bool:
        """Every server group has finished: this server's values are final."""
        return self.finals_sent and not (self.awaiting - self.gone)

    def watching(self) -> list[int]:
        """Peers whose death would leave this server waiting."""
        return sorted(set(self.peers.values()) - self.gone)

    def handle(self, src: int, header: Header) -> None:
        """One message from a peer server (validated: a bad one is rejected, its payload drained)."""
        try:
            if src not in self.group_of:
                raise MessageError(f"{header.op.name} from rank {src}, which is not a neighbour of this server")
            self._validate(src, header)
        except MessageError:
            if src in self.group_of and 0 < header.length <= max(self.copies.sizes):
                self.comm.recv(torch.empty(header.length, dtype=self.shard.dtype), src, tag=PAYLOAD_TAG)
            raise
        payload = None
        if header.length:
            payload = torch.empty(header.length, dtype=self.shard.dtype)
            self.comm.recv(payload, src, tag=PAYLOAD_TAG)
        k = self.group_of[src]
        if header.op is Op.MERGE:
            self._settle(src, self._answer_mark[src])  # src adopted our last answer before it sent this Merge
            if self.copies.master is None:
                self._deferred.append((src, header, payload))
            else:
                self._answer(src, header, payload)
        elif header.op is Op.MERGED:
            self._settle(src, self._merge_mark[src])  # src took everything we sent up to our Merge
            self.copies.adopt(k, payload)
            if self.finishing and src not in self.told:
                self._last(k)
        elif header.op is Op.FINISHED:
            self.finished.add(src)
        elif header.op is Op.FINAL:
            self.copies.settle(k, payload)
            self.awaiting.discard(src)
        self._maybe_final()

    def lose(self, peer: int, why: str) -> None:
        """Forget a peer server that died: no answer, Finished or Final will come from it."""
        if peer in self.gone:
            return
        self.gone.add(peer)
        self.copies.forget(self.group_of[peer])
        self._sends[peer].clear()
        print(f"troupe server rank {self.rank}: server rank {peer} of server group {self.group_of[peer]} is gone "
              f"({why}); its master copies go with it, this server keeps its own values of them",
              file=sys.stderr, flush=True)
        self._maybe_final()
        self._cv.notify_all()

    def close(self, poll: float = WATCH_INTERVAL) -> None:
        """Wait until every live peer has taken the last Merges, answers and Finals (the process may end then).

        Every peer takes them before it finishes. A Gloo send's wait cannot be interrupted, so the waits run
        in a thread, abandoned once a peer they wait for is gone."""
        pending = {peer: list(sends) for peer, sends in self._sends.items() if peer not in self.gone and sends}

        def wait_all() -> None:
            for peer, sends in pending.items():
                for _, h, _ in sends:
                    try:
                        h.wait()
                    except RuntimeError as e:  # Gloo: the peer's connection closed
                        log.warning("troupe server rank %d: a send to server rank %d failed: %s", self.rank, peer, e)
                        break

        thread = threading.Thread(target=wait_all, name="troupe-server-sync-close", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(poll)
            for peer in pending:
                if peer not in self.gone and not self.alive(peer):
                    self.lose(peer, "its process ended or its heartbeat stopped")
            if thread.is_alive() and all(peer in self.gone for peer in pending):
                return

    def stats(self) -> str:
        merges = self.copies.merges
        mean = sum(merges) / len(merges) if merges else 0.0
        return (f"{self.syncs} syncs with server groups {sorted(self.peers)}, {len(merges)} merges into its master "
                f"copy (staleness mean {mean:.2f} max {max(merges, default=0)}), max |master - replica| at an "
                f"adoption {self.copies.drift:.3g}, {self.rejected} peer message(s) rejected, peers gone: "
                f"{sorted(self.gone) or 'none'}")

    # --- internals ----------------------------------------------------------------------------------

    def _serve(self, peer: int) -> None:
        """`peer`'s messages, until its last one (this thread only receives): its Final, or its Finished when
        it masters an empty part (nothing of ours goes to it, so it answers nothing). A receive from this
        peer alone: its connection reset fails this thread only, and the others keep syncing."""
        while True:
            with self.lock:
                if peer in self.gone or (peer in self.finished and peer not in self.awaiting):
                    return
            raw = empty_header()
            try:
                self.comm.recv(raw, peer, tag=HEADER_TAG)
            except RuntimeError as e:  # Gloo: its connection was reset (its process died)
                with self.lock:
                    self.lose(peer, f"receiving from it failed: {reason(e)}")
                return
            with self.lock:
                try:
                    self.handle(peer, Header.decode(raw))
                except MessageError as e:
                    self.rejected += 1
                    log.error("troupe server rank %d: rejected a message from server rank %d: %s", self.rank, peer, e)
                except RuntimeError as e:  # its payload did not come
                    self.lose(peer, f"receiving from it failed: {reason(e)}")
                    return
                self._cv.notify_all()

    def _validate(self, src: int, header: Header) -> None:
        if src in self.gone:
            raise MessageError(f"{header.op.name} from server rank {src}, which this server has forgotten")
        k = self.group_of[src]
        expected = self.copies.sizes[self.copies.group if header.op is Op.MERGE else k]
        check(header, src=src, expected_length=expected or None,
              allowed={Op.MERGE, Op.MERGED, Op.FINISHED, Op.FINAL})
        if header.slice_id != k:
            raise MessageError(f"{header.op.name} from server rank {src} names server group {header.slice_id}, "
                               f"the rank is server group {k}'s")
        if header.op is Op.MERGE and src in self.finished:
            raise MessageError(f"MERGE from server rank {src} after it said FINISHED")
        if header.op is Op.MERGED and k not in self.copies.sent:
            raise MessageError(f"MERGED from server rank {src} without a Merge of part {k} in flight")
        if header.op is Op.FINISHED and src in self.finished:
            raise MessageError(f"FINISHED twice from server rank {src}")
        if header.op is Op.FINAL and (src not in self.finished or not self.finishing or src not in self.awaiting):
            raise MessageError(f"FINAL from server rank {src} before both had finished, or twice")

    def _answer(self, src: int, header: Header, delta: Tensor) -> None:
        version, value = self.copies.fold(delta, header.version)
        self._send(src, Header(Op.MERGED, self.copies.group, version, self.rank, value.numel()), value)

    def _merge(self, k: int) -> None:
        delta = self.copies.request(k)
        self._send(self.peers[k], Header(Op.MERGE, self.copies.group, self.copies.version, self.rank,
                                         delta.numel()), delta)

    def _last(self, k: int) -> None:
        """Our last Merge of part k (its master folds in what is left), then Finished."""
        peer = self.peers[k]
        if self.copies.sizes[k]:
            self._merge(k)
        self._send(peer, Header(Op.FINISHED, self.copies.group, 0, self.rank, 0))
        self.told.add(peer)

    def _finish(self) -> None:
        self.finishing = True
        self.copies.fold_own()
        for k, peer in self.peers.items():
            if peer not in self.gone and k not in self.copies.sent:
                self._last(k)
        self._maybe_final()

    def _maybe_final(self) -> None:
        """Once this server and every live peer have finished, the master copy is final: send it."""
        live = set(self.peers.values()) - self.gone
        if self.finals_sent or not self.finishing or self.copies.master is None:
            return
        if not live <= self.finished & self.told:  # (a Final must follow our Finished: the peer checks that order)
            return
        value = self.copies.final()
        for peer in sorted(live):
            if value.numel():
                self._send(peer, Header(Op.FINAL, self.copies.group, self.copies.version, self.rank, value.numel()),
                           value)
        self.finals_sent = True

    def _send(self, peer: int, header: Header, payload: Tensor | None = None) -> None:
        # Never a blocking send: the peer may be sending to us at this moment (it receives in its loop).
        try:
            for tensor, tag in [(header.encode(), HEADER_TAG)] + ([] if payload is None else [(payload, PAYLOAD_TAG)]):
                self._sends[peer].append((self._sent[peer], self.comm.isend(tensor, peer, tag=tag), tensor))
                self._sent[peer] += 1
        except RuntimeError as e:  # Gloo: the peer's connection is closed
            self.lose(peer, reason(e))
            return
        if header.op is Op.MERGE:
            self._merge_mark[peer] = self._sent[peer]
        elif header.op is Op.MERGED:
            self._answer_mark[peer] = self._sent[peer]

    def _settle(self, peer: int, upto: int) -> None:
        """Complete the sends before `upto`, which the peer's message shows it has taken (no wait: a peer
        receives in order, and it answered or merged only after taking them)."""
        sends = self._sends[peer]
        while sends and sends[0][0] < upto:
            sends.popleft()[1].wait()
