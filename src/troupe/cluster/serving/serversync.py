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
them. A neighbour that dies is forgotten with a logged line, and its part gets a new master: the
next live server group after it (part k: the first of groups k+1, k+2, ... not known gone), which
takes it over from the value it last adopted plus its own change since (`MasterCopies.take_over`);
the others send their Merges of that part there from then on, and take its Final at the end. What
only the dead master held (changes folded in since the new master last adopted) is lost, as a dead
server's own updates are. Every message about a part names it (`slice_id`): a Merge or Final that
comes from a neighbour who knew of a death before this server did waits until this server knows too.
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
        self.ngroups = copies.ngroups
        self.master_of = {k: k for k in range(self.ngroups)}
        """Part -> the server group that holds its master copy now (a dead one's part moves on: `_reassign`)."""
        self.own_workers = set(own_workers)
        """The workers of this server's worker groups: the server finishes when all have stopped."""
        self.every = sync_freq * max(1, len(self.shard.slices))
        self.next_at = self.every
        self.syncs = 0
        self.finishing = False
        self.finals_sent = False
        self.told: set[int] = set()
        """Peers sent our last Merges and Finished."""
        self.finished: set[int] = set()
        """Peers that said Finished."""
        self.awaiting: set[int] = {k for k in peers if copies.sizes[k]}
        """Parts whose Final has not come (the master of an empty part sends none)."""
        self.last_due: set[int] = set()
        """Parts whose last Merge has yet to leave (one of theirs is in flight) once finishing."""
        self.gone: set[int] = set()
        self.rejected = 0
        self.taken_over: list[int] = []
        """Parts this server took over from a dead neighbour, in order."""
        self._deferred: list[tuple[int, Header, Tensor]] = []  # Merges that came before our initial values
        self._early: list[tuple[int, Header, Tensor | None]] = []
        """Merges and Finals from a neighbour who knew of a death before this server did: handled once it does."""
        self._receiving: set[int] = set()
        """Peers a thread receives from now."""
        self._sends: dict[int, deque[tuple[int, Handle, Tensor]]] = {r: deque() for r in peers.values()}
        """Per peer, the sends not yet known to be taken: (sequence number, handle, tensor kept alive)."""
        self._sent = {r: 0 for r in peers.values()}  # sends made to each peer so far
        # A peer has taken every send before the mark once it answers our Merge (sends up to that Merge),
        # or once it Merges again (sends up to our answer to its last Merge).
        self._merge_mark: dict[tuple[int, int], int] = {}  # (peer, part) -> sends up to our last Merge of it
        self._answer_mark: dict[tuple[int, int], int] = {}  # (peer, part) -> sends up to our last answer of it

    # --- the server loop's side ---------------------------------------------------------------------

    def start(self, alive: Callable[[int], bool]) -> None:
        """Start receiving the neighbours' messages; `alive(rank)` tells a dead neighbour from a slow one."""
        self.alive = alive
        for peer in sorted(self.peers.values()):
            self._receive_from(peer)

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
            for k in self._mine():
                if k != self.copies.group:  # taken over before our initial values came
                    self.copies.take_over(k)
            for src, header, delta in self._deferred:
                self._answer(src, header, delta)
            self._deferred.clear()
        if not self.finishing and not (self.own_workers & live):
            self._finish()
        elif not self.finishing and self.shard.updates >= self.next_at:
            self.next_at = self.shard.updates + self.every
            self.syncs += 1
            self.copies.fold_own()
            for k in self._theirs():
                if self.copies.sizes[k] and k not in self.copies.sent:
                    self._merge(k)

    def done(self) -> bool:
        """Every server group has finished: this server's values are final."""
        return self.finals_sent and not self.awaiting

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
        if self._early_from(src, header):
            self._early.append((src, header, payload))  # src knows of a death this server has not seen yet
            return
        self._apply(src, header, payload)
        self._maybe_final()

    def lose(self, peer: int, why: str) -> None:
        """Forget a peer server that died: no answer, Finished or Final will come from it; the parts it
        mastered move to the next live server group (`_reassign`)."""
        if peer in self.gone:
            return
        self.gone.add(peer)
        self._sends[peer].clear()
        moved = self._reassign()
        print(f"troupe server rank {self.rank}: server rank {peer} of server group {self.group_of[peer]} is gone "
              f"({why}); " + ", ".join(f"part {k}'s master copy is server group {self.master_of[k]}'s"
                                       f"{' (this server)' if self.master_of[k] == self.copies.group else ''}"
                                       for k in moved) + " from now on",
              file=sys.stderr, flush=True)
        early, self._early = self._early, []
        for src, header, payload in early:  # what came from those who knew before us, now (or kept again)
            if src not in self.gone:
                if self._early_from(src, header):
                    self._early.append((src, header, payload))
                else:
                    self._apply(src, header, payload)
        self._maybe_final()
        self._cv.notify_all()

    def _early_from(self, src: int, header: Header) -> bool:
        """A Merge of a part this server does not master, or a Final from a neighbour that does not master
        its part, in this server's view: sent by one who knows of a death this server has not seen yet."""
        if header.op not in (Op.MERGE, Op.FINAL):
            return False
        master = self.copies.group if header.op is Op.MERGE else self.group_of[src]
        return self.master_of[header.slice_id] != master

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
                f"{sorted(self.gone) or 'none'}" + (f", parts taken over: {self.taken_over}" if self.taken_over else ""))

    # --- internals ----------------------------------------------------------------------------------

    def _mine(self) -> list[int]:
        """The parts whose master copy this server holds (its own, and those it took over)."""
        return [k for k in range(self.ngroups) if self.master_of[k] == self.copies.group]

    def _theirs(self) -> list[int]:
        """The parts a live neighbour masters: each gets this server's Merges."""
        return [k for k in range(self.ngroups) if self.master_of[k] != self.copies.group]

    def _rank_of(self, group: int) -> int:
        return self.rank if group == self.copies.group else self.peers[group]

    def _reassign(self) -> list[int]:
        """Give every part whose master is gone the first live server group after it (k+1, k+2, ...): the
        same choice on every server once each knows the same deaths. Returns the parts that moved."""
        moved = []
        while True:  # (a send below may find another neighbour gone: its parts move too, in this loop)
            gone = {self.group_of[r] for r in self.gone}
            k = next((k for k in range(self.ngroups) if self.master_of[k] in gone), None)
            if k is None:
                break
            self.master_of[k] = next(g for g in ((k + i) % self.ngroups for i in range(self.ngroups)) if g not in gone)
            self.copies.forget(k)
            self.last_due.discard(k)
            moved.append(k)
            if self.master_of[k] == self.copies.group:
                self.taken_over.append(k)
                self.awaiting.discard(k)
                if self.copies.master is not None:
                    self.copies.take_over(k)
                    if self.finals_sent and self.copies.sizes[k]:  # the others wait for its Final
                        self._send_final(k)
            elif self.copies.sizes[k]:
                self.awaiting.add(k)  # its Final comes from the new master (even if the dead one's came)
                peer = self.peers[self.master_of[k]]
                if self.finishing and peer not in self.told:
                    self.last_due.add(k)  # our last Merge of it goes to the new master
                if peer not in self._receiving:  # it finished with us before it held this part
                    self._receive_from(peer)
        if self.finishing:
            self._send_lasts()
        return moved

    def _receive_from(self, peer: int) -> None:
        self._receiving.add(peer)
        threading.Thread(target=self._serve, args=(peer,), name=f"troupe-server-sync-{peer}", daemon=True).start()

    def _serve(self, peer: int) -> None:
        """`peer`'s messages, until its last one (this thread only receives): the Final of every part it
        masters, or its Finished when those are empty (nothing of ours goes to it, so it answers nothing). A
        receive from this peer alone: its connection reset fails this thread only, and the others keep syncing."""
        while True:
            with self.lock:
                if peer in self.gone or (peer in self.finished and not self._awaited_from(peer)):
                    self._receiving.discard(peer)
                    return
            raw = empty_header()
            try:
                self.comm.recv(raw, peer, tag=HEADER_TAG)
            except RuntimeError as e:  # Gloo: its connection was reset (its process died)
                with self.lock:
                    self._receiving.discard(peer)
                    self.lose(peer, f"receiving from it failed: {reason(e)}")
                return
            with self.lock:
                try:
                    self.handle(peer, Header.decode(raw))
                except MessageError as e:
                    self.rejected += 1
                    log.error("troupe server rank %d: rejected a message from server rank %d: %s", self.rank, peer, e)
                except RuntimeError as e:  # its payload did not come
                    self._receiving.discard(peer)
                    self.lose(peer, f"receiving from it failed: {reason(e)}")
                    return
                self._cv.notify_all()

    def _awaited_from(self, peer: int) -> bool:
        group = self.group_of[peer]
        return any(self.master_of[k] == group for k in self.awaiting)

    def _validate(self, src: int, header: Header) -> None:
        if src in self.gone:
            raise MessageError(f"{header.op.name} from server rank {src}, which this server has forgotten")
        g, k = self.group_of[src], header.slice_id
        if header.op is Op.FINISHED:
            check(header, src=src, expected_length=None, allowed={Op.FINISHED})
            if k != g:
                raise MessageError(f"FINISHED from server rank {src} names server group {k}, the rank is server "
                                   f"group {g}'s")
            if src in self.finished:
                raise MessageError(f"FINISHED twice from server rank {src}")
            return
        if not 0 <= k < self.ngroups:
            raise MessageError(f"{header.op.name} from server rank {src} names part {k}: there are {self.ngroups}")
        check(header, src=src, expected_length=self.copies.sizes[k] or None,
              allowed={Op.MERGE, Op.MERGED, Op.FINAL})
        if header.op is Op.MERGE:
            if self.master_of[k] == g:
                raise MessageError(f"MERGE from server rank {src} of part {k}, whose master copy server group {g} "
                                   "holds itself")
            if src in self.finished:
                raise MessageError(f"MERGE from server rank {src} after it said FINISHED")
        elif header.op is Op.MERGED:
            if self.master_of[k] != g or k not in self.copies.sent:
                raise MessageError(f"MERGED from server rank {src} without a Merge of part {k} to it in flight")
        elif src not in self.finished or not self.finishing or (self.master_of[k] == g and k not in self.awaiting):
            # (a Final from a master this server does not know of yet is kept until it does: `handle`)
            raise MessageError(f"FINAL of part {k} from server rank {src} before both had finished, or twice")

    def _apply(self, src: int, header: Header, payload: Tensor | None) -> None:
        k = header.slice_id
        if header.op is Op.MERGE:
            self._settle(src, self._answer_mark.get((src, k), 0))  # src adopted our last answer before this Merge
            if self.copies.master is None:
                self._deferred.append((src, header, payload))
            else:
                self._answer(src, header, payload)
        elif header.op is Op.MERGED:
            self._settle(src, self._merge_mark[(src, k)])  # src took everything we sent up to our Merge
            self.copies.adopt(k, payload)
            if self.finishing:
                self._send_lasts()
        elif header.op is Op.FINISHED:
            self.finished.add(src)
        elif header.op is Op.FINAL:
            self.copies.settle(k, payload)
            self.awaiting.discard(k)

    def _answer(self, src: int, header: Header, delta: Tensor) -> None:
        k = header.slice_id
        version, value = self.copies.fold(delta, header.version, part=k)
        self._send(src, Header(Op.MERGED, k, version, self.rank, value.numel()), value, part=k)

    def _merge(self, k: int) -> None:
        delta = self.copies.request(k)
        self._send(self._rank_of(self.master_of[k]), Header(Op.MERGE, k, self.copies.version, self.rank,
                                                            delta.numel()), delta, part=k)

    def _send_lasts(self) -> None:
        """Finishing: our last Merge of each part (once the one in flight is answered), then Finished to every
        live neighbour that masters no part whose last Merge is still due."""
        for k in sorted(self.last_due):
            if k not in self.copies.sent:
                self._merge(k)
                self.last_due.discard(k)
        for group, peer in sorted(self.peers.items()):
            if peer in self.gone or peer in self.told:
                continue
            if not any(self.master_of[k] == group for k in self.last_due):
                self._send(peer, Header(Op.FINISHED, self.copies.group, 0, self.rank, 0))
                self.told.add(peer)

    def _finish(self) -> None:
        self.finishing = True
        self.copies.fold_own()
        self.last_due = {k for k in self._theirs() if self.copies.sizes[k]}
        self._send_lasts()
        self._maybe_final()

    def _maybe_final(self) -> None:
        """Once this server and every live peer have finished, the master copies it holds are final: send them."""
        live = set(self.peers.values()) - self.gone
        if self.finals_sent or not self.finishing or self.copies.master is None:
            return
        if not live <= self.finished & self.told:  # (a Final must follow our Finished: the peer checks that order)
            return
        self.finals_sent = True  # first: a part taken over while these leave sends its own Final (`_reassign`)
        for k in self._mine():
            if self.copies.sizes[k]:
                self._send_final(k)

    def _send_final(self, k: int) -> None:
        value = self.copies.final(k)
        for peer in sorted(set(self.peers.values()) - self.gone):
            self._send(peer, Header(Op.FINAL, k, 0, self.rank, value.numel()), value)

    def _send(self, peer: int, header: Header, payload: Tensor | None = None, part: int | None = None) -> None:
        # Never a blocking send: the peer may be sending to us at this moment (it receives in its loop).
        try:
            for tensor, tag in [(header.encode(), HEADER_TAG)] + ([] if payload is None else [(payload, PAYLOAD_TAG)]):
                self._sends[peer].append((self._sent[peer], self.comm.isend(tensor, peer, tag=tag), tensor))
                self._sent[peer] += 1
        except RuntimeError as e:  # Gloo: the peer's connection is closed
            self.lose(peer, reason(e))
            return
        if header.op is Op.MERGE:
            self._merge_mark[(peer, part)] = self._sent[peer]
        elif header.op is Op.MERGED:
            self._answer_mark[(peer, part)] = self._sent[peer]

    def _settle(self, peer: int, upto: int) -> None:
        """Complete the sends before `upto`, which the peer's message shows it has taken (no wait: a peer
        receives in order, and it answered or merged only after taking them)."""
        sends = self._sends[peer]
        while sends and sends[0][0] < upto:
            sends.popleft()[1].wait()
