"""The elastic quorum's keeper (runtime/lighthouse.py), driven tick by tick through its store, no processes."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from troupe.runtime import liveness
from troupe.runtime.lighthouse import Lighthouse
from troupe.runtime.quorum import ASKED, ASKED_COUNT, Decision, ElasticOptions, Quorum, Ready, round_key
from troupe.runtime.ticket import Ticket


@pytest.fixture
def house():
    ticket = Ticket()
    lh = Lighthouse(ticket, ElasticOptions(groups=3, min_groups=2, evict_after=5.0, heartbeat=0.5))
    client = dist.PrefixStore(f"troupe/{ticket.token}/", dist.TCPStore(
        ticket.addr, ticket.port, is_master=False, timeout=datetime.timedelta(seconds=5)))
    yield lh, client
    lh.stop()


def beat(client, *ranks):
    for r in ranks:
        client.add(liveness.key(r), 1)


def ask(client, rank, token, step=-1):
    """What a worker's `Elastic.join` does: its request, then its rank in the log the lighthouse reads."""
    client.set(f"ready/{rank}", Ready(token, step).encode())
    client.append(ASKED, f"{rank} ")
    client.add(ASKED_COUNT, 1)


def latest(client) -> Quorum:
    return Quorum.decode(client.get("latest"))


def tick_for_6s(lh, client, monkeypatch, beating) -> None:
    """Three ticks 2 s apart on a frozen clock, only the ranks in `beating` beating (past evict_after 5)."""
    clock = [1000.0]
    monkeypatch.setattr("troupe.runtime.lighthouse.time.monotonic", lambda: clock[0])
    for r, (count, _) in lh.beats.seen.items():
        lh.beats.seen[r] = (count, clock[0])
    lh.beats_read_at = clock[0] - 1.0  # the last read of the counters, on the frozen clock too
    for _ in range(3):
        clock[0] += 2.0
        beat(client, *beating)
        lh.tick()


def form_all(lh, client) -> Quorum:
    beat(client, 0, 1, 2)
    for r in range(3):
        ask(client, r, f"0.{r}", step=0)
    lh.tick()
    return latest(client)


def test_the_first_quorum_waits_for_every_group_then_heals_all_from_one(house):
    lh, client = house
    beat(client, 0, 1)
    ask(client, 0, "a", step=0)
    ask(client, 1, "b", step=0)
    lh.tick()
    assert not client.check(["latest"]), "formed before every group was ready"
    beat(client, 2)
    ask(client, 2, "c", step=0)
    lh.tick()
    q = latest(client)
    assert (q.id, q.members, q.source, q.joiners, q.base) == (1, (0, 1, 2), 0, (1, 2), 0)


def test_a_group_asking_to_join_is_proposed_to_the_running_quorum(house):
    lh, client = house
    q1 = form_all(lh, client)
    # round 1 of quorum 1 committed by its members, with nothing proposed
    client.set(round_key(q1.id, 1, "d"), Decision(True, q1).encode())
    lh.tick()
    assert lh.cursor == 2 and lh.active == q1
    lh.lost(2)
    lh.restarted(2)
    beat(client, 0, 1, 2)
    # rank 2's old process never voted in round 2: the lighthouse decides it, without rank 2
    lh.tick()
    d = Decision.decode(client.get(round_key(q1.id, 2, "d")))
    assert not d.commit and d.by == "lighthouse" and d.next.members == (0, 1) and d.next.base == q1.id
    assert latest(client) == d.next and lh.active == d.next
    ask(client, 2, "1.1")  # the restarted process is ready
    beat(client, 0, 1, 2)
    lh.tick()
    proposal = Quorum.decode(client.get("proposal"))
    assert proposal.members == (0, 1, 2) and proposal.joiners == (2,) and proposal.source == 0
    assert proposal.base == d.next.id and latest(client) == d.next, "a proposal is not a quorum until adopted"
    # the next round's last voter adopts it; the lighthouse follows and publishes it
    client.set(round_key(d.next.id, 1, "d"), Decision(True, proposal).encode())
    lh.tick()
    assert latest(client) == proposal and lh.active == proposal and lh.admitted[2] == "1.1"


def test_a_round_the_voters_committed_before_the_loss_was_seen_is_kept(house):
    lh, client = house
    q1 = form_all(lh, client)
    client.set(round_key(q1.id, 1, "d"), Decision(True, q1).encode())  # rank 1 voted, then died
    lh.lost(1)
    beat(client, 0, 2)
    lh.tick()
    assert Decision.decode(client.get(round_key(q1.id, 1, "d"))).commit
    aborted = Decision.decode(client.get(round_key(q1.id, 2, "d")))
    assert not aborted.commit and aborted.next.members == (0, 2)


def test_a_silent_group_is_evicted_after_evict_after(house, monkeypatch):
    lh, client = house
    q1 = form_all(lh, client)
    tick_for_6s(lh, client, monkeypatch, beating=(0, 1))  # rank 2 is frozen: its counter stands still
    d = Decision.decode(client.get(round_key(q1.id, 1, "d")))
    assert not d.commit and d.next.members == (0, 1)


def test_a_worker_that_says_goodbye_leaves_at_once_and_only_an_error_is_announced(house):
    """A process on its way out (exit hooks) says so: nobody waits for its silence or its exit."""
    lh, client = house
    said = []
    lh.say = said.append
    q1 = form_all(lh, client)
    client.set("bye/2", "error")
    client.add("byes", 1)
    beat(client, 0, 1, 2)  # still beating: the goodbye, not a silence, makes it leave
    lh.tick()
    d = Decision.decode(client.get(round_key(q1.id, 1, "d")))
    assert not d.commit and d.next.members == (0, 1) and any("[2] left quorum 1" in s for s in said)
    said.clear()
    client.set("bye/1", "done")  # finished its script: leaves too, without a word
    client.add("byes", 1)
    lh.tick()
    assert lh.active is None and not any("left quorum" in s for s in said)
    lh.lost(2)
    lh.restarted(2)  # its old goodbye is forgotten: the new process is not leaving
    assert not client.check(["bye/2"]) and 2 not in lh.said_bye


def test_too_few_groups_pause_until_enough_ask_again(house):
    lh, client = house
    q1 = form_all(lh, client)
    lh.lost(1)
    lh.lost(2)
    beat(client, 0)
    lh.tick()
    d = Decision.decode(client.get(round_key(q1.id, 1, "d")))
    assert not d.commit and d.next is None and lh.active is None
    ask(client, 0, "0.9", step=7)  # the survivor asks again, with its steps
    beat(client, 0)
    lh.tick()
    assert latest(client) == q1, "formed with fewer than min_groups"
    lh.restarted(1)
    ask(client, 1, "1.1")
    beat(client, 0, 1)
    lh.tick()
    q = latest(client)
    assert q.members == (0, 1) and q.source == 0 and q.joiners == (1,) and q.id > q1.id


def test_when_the_members_have_finished_a_waiting_worker_is_told_to_leave(house):
    lh, client = house
    form_all(lh, client)
    for r in (0, 1):
        lh.lost(r, finished=True)
    lh.lost(2)
    lh.tick()
    assert not client.check(["closed"])  # rank 2 (a member) is not finished: the job may still need it
    lh.lost(2, finished=True)
    lh.tick()
    assert client.check(["closed"])


def test_another_nodes_reports_count_as_its_own_supervisors(house):
    """A rank on another node: its launcher's `Reporter` says what it saw through the store, in order."""
    from troupe.runtime.lighthouse import Reporter

    lh, client = house
    q1 = form_all(lh, client)
    node1 = Reporter(lh.ticket, timeout=5)
    assert node1.formed_once
    node1.lost(2)
    beat(client, 0, 1)
    lh.tick()  # at once: no waiting for rank 2's silence
    d = Decision.decode(client.get(round_key(q1.id, 1, "d")))
    assert not d.commit and d.next.members == (0, 1) and 2 in lh.dead
    assert not lh.done(), "ranks 0 and 1 still run"
    node1.restarted(2)
    ask(client, 2, "1.1")
    beat(client, 0, 1, 2)
    lh.tick()
    assert 2 not in lh.dead and Quorum.decode(client.get("proposal")).joiners == (2,)
    lh.lost(0, finished=True)
    lh.lost(1, finished=True)
    node1.lost(2, finished=True)
    lh.tick()
    assert lh.done() and client.check(["closed"])

    class Gone:  # node 0's launcher has exited: its store refuses every call
        def __getattr__(self, name):
            def refuse(*args):
                raise RuntimeError("Connection reset by peer")
            return refuse
    node1.store = Gone()
    node1.lost(3, finished=True)  # a late rank's exit: nothing to tell, and no traceback for it
    node1.restarted(3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(groups=3, min_groups=4), "min_groups (4) is larger than the job's 3 worker groups"),
    (dict(groups=3, min_groups=1), "min_groups must be >= 2"),
    (dict(groups=3, timeout=0), "elastic timeout must be > 0 seconds"),
    (dict(groups=3, heartbeat=3.0, evict_after=5.0), "must be at least two heartbeats"),
    (dict(groups=3, group_size=0), "elastic group_size must be >= 1, got 0"),
    (dict(groups=3, batch="same"), "elastic batch must be one of ['constant', 'shrink'], got 'same'"),
    (dict(groups=3, min_groups=3, max_groups=2), "max_groups (2) must be from min_groups (3) to the job's 3"),
])
def test_bad_elastic_options(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ElasticOptions(**kwargs)


def test_records_round_trip():
    q = Quorum(4, (0, 2), (2,), 0, base=3)
    assert Quorum.decode(q.encode()) == q and q.index(2) == 1
    d = Decision(False, q, by="lighthouse")
    assert Decision.decode(d.encode()) == d and Decision.decode(Decision(True, None).encode()).next is None
    assert ElasticOptions.decode(ElasticOptions(groups=5).encode()) == ElasticOptions(groups=5)
    pairs = Quorum(5, (1, 3), (3,), 1, base=4, tokens=("a|b", "c|d"), group_size=2)
    assert Quorum.decode(pairs.encode()) == pairs and [pairs.index(r) for r in (2, 3, 6, 7)] == [0, 1, 2, 3]
    assert ElasticOptions(groups=2, group_size=3).ranks(1) == range(3, 6)


class _SlowWork:
    """A reduction that ends after `slices` timed-out waits, with `error` (None: success)."""

    def __init__(self, slices: int, error: Exception | None = None, done_during_last_slice: bool = False):
        self.slices, self.error, self.done_during_last_slice = slices, error, done_during_last_slice
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        if timeout is not None and self.waits <= self.slices:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error

    def is_completed(self) -> bool:
        return self.done_during_last_slice and self.waits >= self.slices


def test_a_wait_in_slices_gives_up_only_when_asked_and_keeps_the_reductions_verdict():
    from troupe.runtime.comm import _wait_or_escape

    asked = []
    _wait_or_escape(_SlowWork(3), lambda: asked.append(1))  # slow but healthy: waits on
    assert len(asked) == 3
    # the slice timed out just as the reduction ended: its own verdict, not the timeout
    _wait_or_escape(_SlowWork(1, done_during_last_slice=True), lambda: pytest.fail("asked after it ended"))
    with pytest.raises(ValueError, match="its own"):
        _wait_or_escape(_SlowWork(1, ValueError("its own"), done_during_last_slice=True), lambda: None)
    with pytest.raises(RuntimeError, match="decided without us"):
        _wait_or_escape(_SlowWork(5), lambda: "decided without us")


def test_a_quorum_admits_a_rank_only_for_the_request_it_was_formed_with():
    q = Quorum(3, (0, 2), (2,), 0, base=2, tokens=("0.1", "1.1"))
    assert q.admits(2, "1.1") and not q.admits(2, "0.1") and not q.admits(1, "1.1")


@pytest.fixture
def pairs():
    """3 worker groups of 2 processes: group g is ranks 2g and 2g + 1."""
    ticket = Ticket()
    lh = Lighthouse(ticket, ElasticOptions(groups=3, group_size=2, min_groups=2, evict_after=5.0, heartbeat=0.5))
    client = dist.PrefixStore(f"troupe/{ticket.token}/", dist.TCPStore(
        ticket.addr, ticket.port, is_master=False, timeout=datetime.timedelta(seconds=5)))
    yield lh, client
    lh.stop()


def test_a_group_asks_when_every_process_of_it_has_and_the_quorum_counts_processes(pairs):
    lh, client = pairs
    beat(client, *range(6))
    for r, step in enumerate([-1, 4, 5, 5, 3, 3]):  # group 0 has a fresh process: its state is the fewest steps
        if r != 5:
            ask(client, r, f"t{r}", step=step)
    lh.tick()
    assert not client.check(["latest"]), "formed before every process of every group was ready"
    ask(client, 5, "t5", step=3)
    lh.tick()
    q = latest(client)
    assert (q.members, q.source, q.joiners, q.group_size, q.size) == ((0, 1, 2), 1, (0, 2), 2, 6)
    assert q.tokens == ("t0|t1", "t2|t3", "t4|t5")
    assert [q.index(r) for r in range(6)] == list(range(6)) and q.admits(3, "t3") and not q.admits(3, "t2")


def test_a_lost_process_takes_its_group_out_and_the_group_rejoins_when_all_of_it_asks_again(pairs):
    lh, client = pairs
    said = []
    lh.say = said.append
    beat(client, *range(6))
    for r in range(6):
        ask(client, r, f"0.{r}", step=0)
    lh.tick()
    q1 = latest(client)
    lh.lost(3)  # rank 3 died; its partner rank 2 still runs (the supervisor stops it next)
    beat(client, *range(6))
    lh.tick()
    d = Decision.decode(client.get(round_key(q1.id, 1, "d")))
    assert not d.commit and d.next.members == (0, 2) and d.next.size == 4 and d.next.index(4) == 2
    assert any("worker group(s) [1] left quorum 1" in s for s in said)
    assert d.next.tokens == ("0.0|0.1", "0.4|0.5")
    lh.lost(2)
    for r in (2, 3):
        lh.restarted(r)
    beat(client, *range(6))
    ask(client, 2, "1.1")
    lh.tick()
    assert not client.check(["proposal"]), "proposed a group with one of its processes not ready"
    ask(client, 3, "1.1")
    beat(client, *range(6))
    lh.tick()
    proposal = Quorum.decode(client.get("proposal"))
    assert proposal.members == (0, 1, 2) and proposal.joiners == (1,) and proposal.source == 0
    assert proposal.tokens[1] == "1.1|1.1" and proposal.admits(3, "1.1")
    client.set(round_key(d.next.id, 1, "d"), Decision(True, proposal).encode())
    lh.tick()
    assert lh.active == proposal and (lh.admitted[2], lh.admitted[3]) == ("1.1", "1.1")


def test_one_silent_process_evicts_its_group(pairs, monkeypatch):
    lh, client = pairs
    beat(client, *range(6))
    for r in range(6):
        ask(client, r, f"0.{r}", step=0)
    lh.tick()
    q1 = latest(client)
    tick_for_6s(lh, client, monkeypatch, beating=(0, 1, 2, 3, 4))  # rank 5 is frozen; rank 4, its partner, beats on
    d = Decision.decode(client.get(round_key(q1.id, 1, "d")))
    assert not d.commit and d.next.members == (0, 1)


def test_beyond_max_groups_a_ready_group_stands_by_and_takes_a_lost_members_place():
    """max_groups 2 of 3: the first quorum is 2 groups, the third ready one is not proposed (no
    churn); when a member is lost it joins in the same decision, healing from a survivor."""
    ticket = Ticket()
    lh = Lighthouse(ticket, ElasticOptions(groups=3, min_groups=2, max_groups=2, evict_after=5.0, heartbeat=0.5))
    client = dist.PrefixStore(f"troupe/{ticket.token}/", dist.TCPStore(
        ticket.addr, ticket.port, is_master=False, timeout=datetime.timedelta(seconds=5)))
    try:
        q1 = form_all(lh, client)
        assert q1.members == (0, 1) and q1.joiners == (1,)
        beat(client, 0, 1, 2)
        lh.tick()
        assert not client.check(["proposal"]), "a full quorum was offered the standby"
        lh.lost(1)
        beat(client, 0, 2)
        lh.tick()
        d = Decision.decode(client.get(round_key(q1.id, 1, "d")))
        assert not d.commit and d.next.members == (0, 2) and d.next.joiners == (2,) and d.next.source == 0
    finally:
        lh.stop()


def test_elastic_parameter_servers_keepers_tell_each_other_how_their_node_ended(monkeypatch):
    """Node 0's Keeper hosts the store, another node's connects: a node that stops the job says so with its code
    (the others stop too), and node 0 keeps the store until every node has ended or fallen silent."""
    from troupe.runtime import lighthouse
    from troupe.runtime.keeper import Keeper

    ticket = Ticket()
    host = Keeper(ticket, 6, host=True)
    other = Keeper(ticket, 6, host=False, timeout=5.0)
    assert host.ended() is None and other.ended() is None
    other.beat(1)
    other.end(1, 3)  # node 1 stopped the job: a server died there
    assert host.ended() == 3
    said = []
    host.wait_for_nodes(2, silence=30.0, say=said.append)  # node 1 has ended: no wait
    assert said == []
    # A third node that beat once and then fell silent is given up after `silence` (on a clock that runs fast).
    clock = [0.0]
    monkeypatch.setattr(lighthouse.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(lighthouse.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + 5.0))
    Keeper(ticket, 6, host=False, timeout=5.0).beat(2)
    host.wait_for_nodes(3, silence=30.0, say=said.append)
    assert said == ["troupe run: node 2's launcher has said nothing for 30 s; the job's store (this node's) closes"]


def test_a_keeper_finds_a_server_frozen_once_its_beat_stood_still_past_evict_after_never_one_starting_or_leaving(
        monkeypatch):
    from troupe.runtime import lighthouse
    from troupe.runtime.keeper import Keeper
    from troupe.runtime.rejoin import closing_key

    keeper = Keeper(Ticket(), 4, host=True)
    clock = [0.0]
    monkeypatch.setattr(lighthouse.time, "monotonic", lambda: clock[0])

    def look(dt: float) -> dict[int, float]:
        clock[0] += dt
        return keeper.frozen([1, 2, 3], evict_after=2.0)

    keeper.store.add(liveness.key(2), 1)
    keeper.store.add(liveness.key(3), 1)
    assert look(0.0) == {}
    assert look(0.125) == {}  # looked at most every BEAT_SECONDS: nothing read
    keeper.store.add(liveness.key(2), 1)  # rank 2 beats on; rank 3 stops; rank 1 never started beating
    assert look(1.0) == {}
    keeper.store.set(closing_key(3), "1")
    assert look(1.5) == {}  # rank 3 stood still 2.625 s, but it said it is leaving
    keeper.store.add(liveness.key(3), 1)  # (a process that said so and beats again: the mark stays, it is let be)
    assert look(0.5) == {2: 2.0}  # rank 2 stood still since its beat seen at 1.125 s: frozen
    keeper.store.delete_key(closing_key(3))
    assert look(2.0) == {2: 4.0, 3: 2.0}  # rank 1: still starting (no beat yet), never frozen
