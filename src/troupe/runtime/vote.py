"""An elastic step's vote: one decision per round, the same on every member, the store touched O(1) times.

Every member of a quorum votes once per step (`Elastic.vote`), after the step's reduction: did it succeed on this
member? The round's `Decision` (commit or not, and the next quorum) lives in one key of the launcher's store,
``q<id>/r<k>/d`` (runtime/quorum.py), written once by compare-and-set, and is what every member applies; the
lighthouse (runtime/lighthouse.py) follows the rounds through those keys and writes one itself when a member is
lost (that member will never vote).

**The fast path** (`fast`), over the quorum's process group (the default group; Gloo):

1. every member's ballot, three integers (failed: 0 or 1; 1; the round), is summed on the way to the quorum's
   leader (its process at index 0) through a binomial tree of point-to-point messages (`tree`: log2 of the
   quorum's size hops, where Gloo's all-reduce, a ring, takes twice the size);
2. the leader checks the sums (as many voters as members, all in this round: else the group is out of step
   and it asks everyone to vote through the store), reads whether the lighthouse proposed a new quorum (one
   counter a step, `PROPOSALS`; the proposal itself only when the counter moved) and compare-and-sets the
   round's decision into the store;
3. the leader broadcasts one integer (Gloo's broadcast: a binomial tree too): `SAME` (what it stored is
   "commit, same quorum, by vote": every member makes that decision itself), `STORED` (something else is
   stored, a new quorum or the lighthouse's decision: every member reads it from the store) or `USE_STORE`
   (nothing was decided: everyone votes through the store).

So a round with nothing lost and nobody joining costs the store two operations, the leader's, whatever the
quorum's size; a round that changes the quorum costs one read per member more (rare: joins, losses).

**The store path** (`through_store`, what every round did before, and still does under a backend other than
Gloo, whose groups carry no CPU tensors): every member counts itself in ``n`` (and its
failure in ``bad``) and reads the decision, waiting for it; the member that makes ``n`` reach the quorum's
size writes it. A member takes it when the leader says `USE_STORE`, and when one of its vote collectives fails
or is given up; then it counts as a failed vote whatever its step did (its group may be out of step: a
round voted that way never commits, and a failed round rebuilds the group, `Elastic.advance`).

Why every member applies one and the same decision (the races):

* *The one record.* The decision is whatever the first compare-and-set of ``d`` stored; the leader writes ``d``
  before it broadcasts, and broadcasts what ``d`` holds, not what it wrote. A member that received the broadcast
  holds ``d``'s value; one that did not reads ``d`` (waiting for it). Who writes ``d`` when the leader never gets
  that far: the lighthouse, when a member (the leader included) is lost; otherwise the store path's last voter,
  since every member then reaches the store path (one that got no broadcast counts itself in ``n``, and one that
  got it knows ``d`` is written).
* *A wait in a vote collective* is given up (`decided_without_us`, polled every `ESCAPE_SLICE` of waiting, or
  less often in a large quorum, `quorum.poll_interval`; never on a fast round) once the lighthouse decided this
  round, or decided the next one, or a member counted itself in the store path's ``n``: a lost member's
  neighbours in the tree see their sockets close, the others would wait for the group's whole timeout, and a
  member that fell back to the store never sends its ballot.
* *The lighthouse decides the round without the leader's vote* (a member lost after its ballot rose, or before
  it so that the ballots never all arrive): the leader's compare-and-set returns the lighthouse's decision and it
  broadcasts `STORED`; a member still waiting gives up and reads ``d``. That decision never commits, so the
  group, with an operation perhaps still in flight, is set aside and rebuilt.
* *A member dies between its ballot and the broadcast*: the leader had every ballot and stores "commit",
  which stands (the dead member's gradient is in the step, as in a step where it died just after voting); the
  broadcast reaches the others or fails, and a member whose broadcast failed reads ``d``. The lighthouse then
  decides the next round without the dead member. *The leader dies after storing and before broadcasting*: the
  members read ``d`` once their broadcast fails or the lighthouse decides the next round.
* *A member's own failure, nobody lost*: its failed ballot is in the sums and the leader stores "not
  committed, same quorum" (`STORED`); if its group broke with the failure, its collective fails at once, it votes
  failed through the store, and the others give up their wait and follow. Either way the decision is the vote's,
  with the same quorum, and that member raises its error as before.
* *A member lost or frozen inside the tree*: its parent's receive fails at once when it died (its socket closes),
  or waits when it is frozen. A member that missed a child's sums sends what it has (the leader sees too few
  voters and says `USE_STORE`) and votes failed through the store; a wait is given up as above once the
  lighthouse, having heard of the loss or evicted the silent member, decides the round. A point-to-point wait
  cannot be given up in Gloo (its timed wait closes the connection), so the tree's messages wait in a thread of
  their own, which a member that gave up leaves behind with the group: the round does not commit and the group is
  set aside until its timeout, never reused.
* *A joiner adopting a new quorum at a step boundary*: the leader, like the last voter before, puts the
  lighthouse's proposal into the decision; every member reads it from the store (`STORED`) and moves to it in
  `advance`, and the joiners, which were never in the old group, wait for it in ``latest`` as before. A proposal the
  leader has not seen yet is adopted at a later round; one for an older quorum is ignored (its ``base``).
* *`interrupted()`*, which a step's reduction polls while it waits, asks whether round k+1 is decided while the
  members are still reducing for it: only the lighthouse (or a store-path round's last voter, which needs every
  member's vote) can decide it then; the leader decides round k+1 only once every member's ballot reached it,
  after every reduction of the step.
* *Left out of step*: a vote collective that fails on one member while the leader stored "commit" (it timed out
  with nobody lost: a host stalled for the group's whole timeout) leaves that member's group in use; its next
  collectives may fail, and, as with a step's reduction that times out with nobody lost, such a failure is the
  rank's own. The tree's messages are tagged with the round, and the ballot's round and voter count make sums
  that are not this round's a fallback, never a decision.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from troupe.runtime.comm import ESCAPE_SLICE, _wait_or_escape
from troupe.runtime.quorum import PROPOSALS, Decision, Quorum, round_key

log = logging.getLogger("troupe.elastic")
SAME, STORED, USE_STORE = 0, 1, 2
"""What the leader broadcasts: the decision is "commit, same quorum, by vote"; another decision is stored (read
it); nothing was decided (vote through the store)."""
LEADER = 0
"""The index in the quorum's process group of the process that decides a round on the fast path."""


class Unfinished(Exception):
    """A vote collective failed or was given up: this member votes through the store."""


class Exchange(Protocol):
    """The vote's two exchanges over the quorum's process group."""

    def reduce(self, values: list[int]) -> list[int] | None:
        """At the leader, the elementwise sum of every member's `values` (None elsewhere); raises `Unfinished`."""

    def broadcast(self, value: int) -> int:
        """The leader's `value` on every member; raises `Unfinished`."""


def tree(index: int, size: int) -> tuple[int | None, list[int]]:
    """The parent (None at the root, index 0) and the children of process `index` in a binomial tree over `size`
    processes: ballots rise through it in ceil(log2(size)) hops (Gloo's all-reduce is a ring: 2(size - 1) hops).

    >>> tree(0, 8), tree(4, 8), tree(6, 8)
    ((None, [1, 2, 4]), (0, [5, 6]), (4, [7]))
    """
    children, mask = [], 1
    while mask < size:
        if index & mask:
            return index - mask, children
        if index + mask < size:
            children.append(index + mask)
        mask <<= 1
    return None, children


class Proposals:
    """The lighthouse's proposal as a quorum's leader reads it: one counter a round, the proposal only when the
    counter moved."""

    def __init__(self) -> None:
        self.seen = 0
        self.last: Quorum | None = None

    def pending(self, store, quorum: Quorum) -> Quorum | None:  # noqa: ANN001  (a Store)
        """The proposal that replaces `quorum`, if the lighthouse wrote one."""
        count = store.add(PROPOSALS, 0)
        if count != self.seen:
            self.seen, self.last = count, Quorum.decode(store.get("proposal"))
        return self.last if self.last is not None and self.last.base == quorum.id else None


def ballot(ok: bool, k: int) -> list[int]:
    """What a member adds to round `k`'s sums: failed, one voter, the round."""
    return [0 if ok else 1, 1, k]


def tally(summed: list[int], quorum: Quorum, k: int) -> int | None:
    """The failed ballots of round `k`, or None when the sums are not one ballot of round `k` per member (some
    member's collectives are out of step with the others')."""
    bad, voters, rounds = summed
    if voters != quorum.size or rounds != k * quorum.size or not 0 <= bad <= quorum.size:
        return None
    return bad


def code_of(stored: Decision, quorum: Quorum) -> int:
    """What the leader broadcasts for the decision the store holds."""
    return SAME if stored == Decision(True, quorum) else STORED


def decision_of(code: int, quorum: Quorum) -> Decision | None:
    """The decision a member makes itself from the leader's `code` (None: read it from the store)."""
    if code == SAME:
        return Decision(True, quorum)
    if code in (STORED, USE_STORE):
        return None
    raise ValueError(f"the leader broadcast {code}, which is not a vote code ({SAME}, {STORED}, {USE_STORE})")


def fast(store, quorum: Quorum, k: int, index: int, ok: bool, exchange: Exchange,  # noqa: ANN001  (a Store)
         proposal: Callable[[], Quorum | None]) -> tuple[Decision | None, bool]:
    """Round `k` on the fast path, as the quorum's process `index`: (the decision, or None when the leader
    asks for the store path; whether every collective of the vote finished on this member). Raises `Unfinished`
    when one failed or was given up before this member knew the decision."""
    summed = exchange.reduce(ballot(ok, k))
    d = round_key(quorum.id, k, "d")
    if index != LEADER:
        code = exchange.broadcast(USE_STORE)
        if code not in (SAME, STORED, USE_STORE):  # not the leader's code: this member is out of step
            raise Unfinished(f"the leader's broadcast carried {code}, not a vote code")
        if code == USE_STORE:
            return None, True
        return decision_of(code, quorum) or Decision.decode(store.get(d)), True
    bad = tally(summed, quorum, k)
    if bad is None:
        exchange.broadcast(USE_STORE)
        return None, True
    stored = Decision.decode(store.compare_set(d, "", Decision(bad == 0, proposal() or quorum).encode()))
    try:
        exchange.broadcast(code_of(stored, quorum))
    except Unfinished:
        return stored, False  # decided all the same: the others read it from the store
    return stored, True


def cast(store, quorum: Quorum, k: int, index: int, ok: bool, exchange: Exchange,  # noqa: ANN001  (a Store)
         proposal: Callable[[], Quorum | None], stored_proposal: Callable[[], Quorum | None]) -> tuple[Decision, bool]:
    """Round `k`'s decision as the quorum's process `index` sees it, and whether every vote collective finished
    here: the fast path; the store path when the leader asks for it, or (as a failed vote) when a collective
    failed or was given up. `proposal`: the leader's read of the lighthouse's proposal (`Proposals`);
    `stored_proposal`: the store path's last voter's."""
    try:
        decision, clean = fast(store, quorum, k, index, ok, exchange, proposal)
    except Unfinished as e:
        log.info("troupe: quorum %d's round %d is voted through the store by its process %d (%s)", quorum.id, k,
                 index, e)
        return through_store(store, quorum, k, False, stored_proposal), False
    if decision is None:
        return through_store(store, quorum, k, ok, stored_proposal), True
    return decision, clean


def through_store(store, quorum: Quorum, k: int, ok: bool,  # noqa: ANN001  (a Store)
                  proposal: Callable[[], Quorum | None]) -> Decision:
    """Round `k` through the store alone: count this member (and its failure); the last to count writes the
    decision; everyone reads what was written first (waiting for it)."""
    key = lambda what: round_key(quorum.id, k, what)  # noqa: E731
    if not ok:
        store.add(key("bad"), 1)
    if store.add(key("n"), 1) == quorum.size:
        bad = store.add(key("bad"), 0)
        store.compare_set(key("d"), "", Decision(bad == 0, proposal() or quorum).encode())
    return Decision.decode(store.get(key("d")))


def decided_without_us(store, quorum: Quorum, k: int) -> str | None:  # noqa: ANN001  (a Store)
    """Why a member waiting in round `k`'s collectives should give them up: the lighthouse decided round `k`
    (a member was lost) or round k+1 (the leader was lost after storing round `k`), or a member votes round `k`
    through the store. None: keep waiting."""
    if store.check([round_key(quorum.id, k + 1, "d")]):
        return f"quorum {quorum.id}'s round {k + 1} was decided by the lighthouse (a member was lost)"
    if store.check([round_key(quorum.id, k, "n")]):
        return f"a member of quorum {quorum.id} votes round {k} through the store"
    d = round_key(quorum.id, k, "d")
    if store.check([d]) and Decision.decode(store.get(d)).by == "lighthouse":
        return f"quorum {quorum.id}'s round {k} was decided by the lighthouse (a member was lost)"
    return None


class GroupExchange:
    """`Exchange` over the default process group (the quorum's): the tree of ballots, then Gloo's broadcast. Each
    wait gives up once `escape` says why (a point-to-point wait cannot be given up in Gloo, whose timed wait closes
    the connection: the tree's messages wait in a thread of their own, on the group it was made with, left behind
    with that group, which a member that gave up never reuses)."""

    def __init__(self, index: int, size: int, tag: int, escape: Callable[[], str | None]):
        from torch.distributed import distributed_c10d as c10d

        self.index, self.size, self.tag, self.escape = index, size, tag, escape
        self.group = c10d._get_default_group()
        """The quorum's group, held: the thread of the tree may outlive its time as the default group."""

    def reduce(self, values: list[int]) -> list[int] | None:
        done: list[tuple[list[int] | None, str | None]] = []
        worker = threading.Thread(target=self._rise, args=(values, done), name="troupe-vote", daemon=True)
        worker.start()
        while True:
            worker.join(ESCAPE_SLICE.total_seconds())
            if not worker.is_alive():
                break
            reason = self.escape()
            if reason is not None:
                raise Unfinished(reason)
        summed, error = done[0]
        if error is not None:
            raise Unfinished(error)
        return summed

    def _rise(self, values: list[int], done: list[tuple[list[int] | None, str | None]]) -> None:
        """Sum the children's partial sums into ours, send it to the parent (in the helper thread, on the group's
        own ranks). A child lost leaves its subtree's ballots out (the leader sees too few voters) and makes this
        member's vote unfinished."""
        parent, children = tree(self.index, self.size)
        total, error = torch.tensor(values, dtype=torch.int64), None
        try:
            for child in children:
                part = torch.zeros_like(total)
                try:
                    self.group.recv([part], child, self.tag).wait()
                    total += part
                except RuntimeError as e:
                    error = f"no ballots from process {child} of the quorum ({_first_line(e)})"
            if parent is not None:
                try:
                    self.group.send([total], parent, self.tag).wait()
                except RuntimeError as e:
                    error = f"its ballots did not reach process {parent} of the quorum ({_first_line(e)})"
        except Exception as e:  # noqa: BLE001  (anything else: the member votes through the store, never hangs)
            error = f"{type(e).__name__}: {_first_line(e)}"
        finally:
            done.append((None if parent is not None else [int(v) for v in total.tolist()], error))

    def broadcast(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        try:
            _wait_or_escape(dist.broadcast(t, LEADER, group=self.group, async_op=True), self.escape)
        except RuntimeError as e:  # a peer's socket closed, the group's timeout, or given up (escape)
            raise Unfinished(_first_line(e)) from None
        return int(t.item())


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e) else type(e).__name__
