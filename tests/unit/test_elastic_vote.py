"""The elastic step's vote (runtime/vote.py) without processes: its pure parts, then whole rounds of members as
threads over an in-memory exchange and a HashStore, members failing and lost at each point of the round."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from troupe.runtime import vote
from troupe.runtime.quorum import PROPOSALS, Decision, Quorum, round_key

Q = Quorum(3, (0, 1, 2, 3))


class Counting:
    """A store that counts the operations made through it."""

    def __init__(self, store):
        self.store, self.ops = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.ops += 1
            return method(*args, **kwargs)

        return counted


class Threads:
    """The vote's collectives among `n` threads (a Barrier per collective: a member that never arrives makes
    every other's wait fail after `timeout`, as a lost peer fails a Gloo collective)."""

    def __init__(self, n: int, timeout: float = 1.0):
        self.n, self.timeout = n, timeout
        self.barrier = threading.Barrier(n)
        self.sums: list[list[int]] = [[] for _ in range(n)]
        self.value = [0]

    def member(self, index: int, die_before: str | None = None) -> vote.Exchange:
        threads = self

        class Member:
            def reduce(self, values):
                threads._meet("reduce", die_before)
                threads.sums[index] = values
                threads._meet("reduce", None)
                return [sum(col) for col in zip(*threads.sums)] if index == vote.LEADER else None

            def broadcast(self, value):
                if index == vote.LEADER:
                    threads.value[0] = value
                threads._meet("broadcast", die_before)
                return threads.value[0]

        return Member()

    def _meet(self, what: str, die_before: str | None) -> None:
        if die_before == what:
            raise SystemExit  # the thread ends: this member is lost
        if die_before == "broken":
            raise vote.Unfinished("this member's group is broken")
        try:
            self.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise vote.Unfinished(f"{what}: a member did not come") from None


def store(timeout: float = 10.0) -> dist.HashStore:
    s = dist.HashStore()
    s.set_timeout(datetime.timedelta(seconds=timeout))
    return s


def run_round(shared, q, k, oks, threads, *, die=None, proposal=None):
    """Every member's `vote.cast` of round k in a thread; their (decision, clean) by index (None: lost), and
    their store operation counts."""
    results: dict[int, tuple[Decision, bool] | None] = {}
    counts: dict[int, int] = {}
    proposals = vote.Proposals()

    def member(i):
        mine = Counting(shared)
        results[i] = None

        def pending():
            if (die or {}).get(i) == "deciding":
                raise SystemExit  # the leader is lost after the ballots rose, before it stores a decision
            return proposals.pending(mine, q)

        try:
            results[i] = vote.cast(mine, q, k, i, oks[i], threads.member(i, (die or {}).get(i)), pending,
                                   lambda: proposal)
        except SystemExit:
            pass  # this member is lost (its result stays None)
        finally:
            counts[i] = mine.ops

    ts = [threading.Thread(target=member, args=(i,)) for i in range(q.size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts), "a member never decided"
    return results, counts


# --- the pure parts --------------------------------------------------------------------------------------


def test_a_tally_counts_failed_ballots_and_refuses_sums_that_are_not_one_ballot_per_member_of_the_round():
    sums = [sum(col) for col in zip(vote.ballot(True, 7), vote.ballot(False, 7), vote.ballot(True, 7),
                                    vote.ballot(False, 7))]
    assert vote.tally(sums, Q, 7) == 2
    assert vote.tally(sums, Q, 8) is None  # a member's ballot of another round
    three = [sum(col) for col in zip(*[vote.ballot(True, 7)] * 3)]
    assert vote.tally(three, Q, 7) is None  # a member missing
    assert vote.tally([9, 4, 28], Q, 7) is None  # more failures than members: not ballots


def test_only_commit_on_the_same_quorum_by_vote_is_made_by_members_themselves():
    assert vote.code_of(Decision(True, Q), Q) == vote.SAME
    assert vote.decision_of(vote.SAME, Q) == Decision(True, Q)
    other = Quorum(4, (0, 1, 2), base=3)
    for d in (Decision(False, Q), Decision(True, other), Decision(False, other, by="lighthouse"),
              Decision(False, None, by="lighthouse")):
        assert vote.code_of(d, Q) == vote.STORED
    assert vote.decision_of(vote.STORED, Q) is None
    with pytest.raises(ValueError, match="the leader broadcast 7, which is not a vote code"):
        vote.decision_of(7, Q)


def test_the_leader_reads_the_proposal_only_when_the_lighthouse_counted_a_new_one():
    s = Counting(store())
    p = vote.Proposals()
    assert p.pending(s, Q) is None and s.ops == 1  # one counter read, no proposal
    nxt = Quorum(5, (0, 1, 2, 3, 4), joiners=(4,), source=0, base=Q.id)
    s.store.set("proposal", nxt.encode())
    s.store.add(PROPOSALS, 1)
    assert p.pending(s, Q) == nxt and s.ops == 3  # the counter moved: the proposal read once
    assert p.pending(s, Q) == nxt and s.ops == 4  # then the counter alone
    assert p.pending(s, Quorum(5, (0, 1, 2, 3, 4))) is None  # a proposal for another quorum is not this one's


def test_the_ballots_tree_reaches_every_process_once_in_log2_hops():
    for size in (1, 2, 3, 7, 64, 100, 4096):
        seen, depth = {0}, {0: 0}
        for i in range(size):
            parent, children = vote.tree(i, size)
            assert (parent is None) == (i == 0)
            for c in children:
                assert vote.tree(c, size)[0] == i and c not in seen
                seen.add(c)
        for i in range(1, size):
            depth[i] = depth[vote.tree(i, size)[0]] + 1
        assert seen == set(range(size))
        assert max(depth.values()) == max(bin(i).count("1") for i in range(size)) <= (size - 1).bit_length()


def test_waiting_members_ask_the_store_every_slice_in_a_small_quorum_and_within_a_budget_in_a_large_one():
    from troupe.runtime.quorum import POLL_READS_PER_S, poll_interval

    assert poll_interval(4) == poll_interval(200) == 0.1
    for size in (1000, 4096, 10_000):
        assert size / poll_interval(size) == pytest.approx(POLL_READS_PER_S)  # the quorum's reads a second


# --- whole rounds ---------------------------------------------------------------------------------------


def test_a_round_with_nothing_lost_touches_the_store_twice_whatever_the_quorum_s_size():
    for members in ((0, 1), (0, 1, 2, 3, 4, 5, 6, 7)):
        q = Quorum(2, members)
        shared = store()
        for k in (1, 2, 3):
            results, counts = run_round(shared, q, k, [True] * q.size, Threads(q.size))
            assert all(r == (Decision(True, q), True) for r in results.values())
            assert counts == {0: 2, **{i: 0 for i in range(1, q.size)}}  # the leader's counter read, its decision
            assert Decision.decode(shared.get(round_key(q.id, k, "d"))) == Decision(True, q)


def test_a_failed_ballot_fails_the_round_on_every_member_by_vote():
    shared = store()
    results, counts = run_round(shared, Q, 1, [True, True, False, True], Threads(4))
    assert set(results.values()) == {(Decision(False, Q), True)}
    assert counts == {0: 2, 1: 1, 2: 1, 3: 1}  # the others read what was stored (not "commit, same quorum")


def test_a_pending_proposal_is_the_next_quorum_on_every_member():
    shared = store()
    nxt = Quorum(4, (0, 1, 2, 3, 4), joiners=(4,), source=0, base=Q.id)
    shared.set("proposal", nxt.encode())
    shared.add(PROPOSALS, 1)
    results, _ = run_round(shared, Q, 1, [True] * 4, Threads(4))
    assert set(results.values()) == {(Decision(True, nxt), True)}


def test_a_round_the_lighthouse_decided_first_is_the_lighthouse_s_on_every_member():
    shared = store()
    theirs = Decision(False, Quorum(4, (0, 1, 3), base=Q.id), by="lighthouse")
    shared.compare_set(round_key(Q.id, 1, "d"), "", theirs.encode())
    results, _ = run_round(shared, Q, 1, [True] * 4, Threads(4))
    assert set(results.values()) == {(theirs, True)}


def test_a_member_lost_between_its_ballot_and_the_broadcast_leaves_the_leader_s_commit_everywhere():
    shared = store()
    results, _ = run_round(shared, Q, 1, [True] * 4, Threads(4, timeout=0.5), die={2: "broadcast"})
    assert results[2] is None
    # every survivor's broadcast failed here (harsher than Gloo, where it reaches those still alive): the leader
    # keeps what it stored, the others read it
    assert {r[0] for i, r in results.items() if i != 2} == {Decision(True, Q)}


def test_the_leader_lost_before_deciding_leaves_the_lighthouse_s_decision_everywhere():
    shared = store()
    theirs = Decision(False, Quorum(4, (1, 2, 3), base=Q.id), by="lighthouse")

    def lighthouse():
        # it decides once the survivors counted themselves in the store path (they wait for the decision)
        while shared.add(round_key(Q.id, 1, "n"), 0) < 3:
            time.sleep(0.01)
        shared.compare_set(round_key(Q.id, 1, "d"), "", theirs.encode())

    watcher = threading.Thread(target=lighthouse)
    watcher.start()
    results, _ = run_round(shared, Q, 1, [True] * 4, Threads(4, timeout=0.5), die={0: "deciding"})
    watcher.join(10)
    assert results[0] is None
    assert {results[i] for i in (1, 2, 3)} == {(theirs, False)}


def test_the_leader_lost_after_storing_leaves_its_commit_everywhere():
    shared = store()
    results, _ = run_round(shared, Q, 1, [True] * 4, Threads(4, timeout=0.5), die={0: "broadcast"})
    assert results[0] is None
    assert {results[i] for i in (1, 2, 3)} == {(Decision(True, Q), False)}


def test_a_member_whose_group_broke_and_the_others_it_left_waiting_end_in_one_failed_round_by_vote():
    shared = store()
    # member 1's failed step broke its group: its ballot fails at once and it votes through the store; the
    # others' sums never complete, they give up and follow it there
    results, _ = run_round(shared, Q, 1, [True, False, True, True], Threads(4, timeout=0.3), die={1: "broken"})
    assert set(results.values()) == {(Decision(False, Q), False)}
    assert shared.add(round_key(Q.id, 1, "n"), 0) == 4
