"""Distributed Hogwild's groups under `troupe run --elastic` (`troupe.cluster.serving.lives`, `groupsync`),
in one process: each group a `GroupSync` with its threads, every link a real Gloo pair made through one
store, beats counted by the test. A group that stops beating is gone for the others; its new life takes
the first live group's replica and optimizer state, and its own part of the master copy from the group
that adopted it last; the others dial the new life and sync with it again."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from troupe.cluster.serving.groupsync import GroupSync, SyncChannels
from troupe.cluster.serving.lives import Lives, life_key
from troupe.cluster.serving.mastercopies import MasterCopies
from troupe.cluster.serving.shard import ParamShard, plan_slices
from troupe.cluster.wire.links import Links
from troupe.runtime import liveness

NUMELS = [7, 4]
W0 = torch.arange(11.0)
GROUPS = 3


def group(store: dist.Store, rank: int, life: int, *, rejoining: bool = False, ngroups: int = GROUPS) -> GroupSync:
    """Group `rank` (one process, one server holding every slice) at its life `life`, started."""
    slices = plan_slices(NUMELS, 1)
    template = torch.optim.SGD([torch.zeros(n) for n in NUMELS], lr=0.1, momentum=0.9)
    shard = ParamShard(slices, template, [0, 0], {rank: {rank}})
    offsets = [0, NUMELS[0]]
    for s in slices:
        start = offsets[s.param] + s.start
        shard.put(s.id, W0[start : start + s.numel] if not rejoining else torch.randn(s.numel))
    serving, asking = (Links(store, rank, 30.0, connect=lambda: store, form=2.0) for _ in range(2))
    lives = Lives(serving, asking, lambda: store, rank, life, evict_after=1.5)
    sync = GroupSync(SyncChannels.relinking(serving, asking, lives), MasterCopies(shard, rank, ngroups),
                     rank_of=lambda k: k)
    sync.start(rejoining=rejoining)
    return sync


def train(sync: GroupSync, seed: int) -> None:
    """One step of this group's server: a gradient into its optimizer (momentum state grows)."""
    shard = sync.copies.shard
    torch.manual_seed(seed)
    with sync.holding():
        for k in shard.slices:
            shard.apply(k, torch.randn(shard.slices[k].numel))


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_a_new_life_takes_a_live_groups_replica_and_its_freshest_part_then_the_others_sync_with_it(capsys):
    store = dist.HashStore()
    beating = {0, 1, 2}
    stop = threading.Event()

    def beat() -> None:  # each live process's beat thread
        while not stop.is_set():
            for r in list(beating):
                store.add(liveness.key(r), 1)
            stop.wait(0.1)

    threading.Thread(target=beat, daemon=True).start()
    groups = [group(store, r, 0) for r in range(GROUPS)]
    wait_for(lambda: all(g.lives.ready(p) for g in groups for p in g.peers.values()), "the first links formed")
    for step in range(3):  # every group trains and syncs in turn
        for g in groups:
            train(g, seed=10 * step + g.group)
            g.sync()
    assert all(not g.gone for g in groups)

    # Group 2 dies (it stops beating and answering); the others go on and count it gone.
    beating.discard(2)
    dead = groups[2]
    wait_for(lambda: all(2 in g.gone for g in groups[:2]), "group 2 counted gone", timeout=10)
    for step in range(3, 5):
        for g in groups[:2]:
            train(g, seed=10 * step + g.group)
            g.sync()  # group 2 is left out
    # Its new life starts from other (random) values. The others dial it at once; a Sync it gets before it
    # has its state is answered "no state": the sender keeps its change (its last adoption stays as it was).
    beating.add(2)
    life = group(store, 2, 1, rejoining=True)
    assert store.get(life_key(2)) == b"1"
    wait_for(lambda: 2 not in groups[0].gone, "group 0 dialled the new life")
    before = groups[0].copies.gather(2, groups[0].copies.shard.last_sync).clone()
    seen = groups[0].seen[2]
    groups[0].sync()
    assert not groups[0].copies.sent and groups[0].seen[2] == seen
    torch.testing.assert_close(groups[0].copies.gather(2, groups[0].copies.shard.last_sync), before, rtol=0, atol=0)

    healthy = groups[0].copies.shard
    freshest = max(groups[:2], key=lambda g: g.seen[2])
    want_part = freshest.copies.gather(2, freshest.copies.shard.last_sync).clone()
    want_values = {k: v.clone() for k, v in healthy.last_sync.items()}
    want_momentum = {k: s["momentum_buffer"].clone() for k, s in healthy.optimizer.state_dict()["state"].items()}
    want_version = freshest.seen[2]
    assert life.rejoin(20.0)
    shard = life.copies.shard
    for k, want in want_values.items():  # the first answer's replica (rank 0), but for its own part
        got = shard.values[k]
        for s, lo, hi in life.copies.parts[2]:
            if s.id == k:
                want = want.clone()
                want[lo:hi] = got[lo:hi]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(shard.last_sync[k], got, rtol=0, atol=0)
    torch.testing.assert_close(life.copies.gather(2), want_part, rtol=0, atol=0)  # the freshest adoption of it
    torch.testing.assert_close(life.master, want_part, rtol=0, atol=0)
    assert life.copies.version == want_version
    got_momentum = {k: s["momentum_buffer"] for k, s in shard.optimizer.state_dict()["state"].items()}
    assert got_momentum.keys() == want_momentum.keys()
    for k in want_momentum:
        torch.testing.assert_close(got_momentum[k], want_momentum[k], rtol=0, atol=0)

    # The others dial the new life and sync with it again; its master copy folds their changes in.
    wait_for(lambda: 2 not in groups[1].gone, "group 2 back for group 1")
    assert all(g.returned == 1 for g in groups[:2])
    version = life.copies.version
    for g in groups[:2]:
        train(g, seed=99 + g.group)
        g.sync()
    assert life.copies.version == version + 2
    closing = [threading.Thread(target=g.close, args=(10,)) for g in (*groups[:2], life)]  # each waits for the others
    for t in closing:
        t.start()
    for t in closing:
        t.join()
    assert "rank 2 is back (life 1); syncing with its group again" in capsys.readouterr().err
    stop.set()
    dead.lives.close()


@pytest.mark.timeout(60)
def test_a_new_life_with_no_live_group_says_so_or_leaves_when_every_group_had_finished():
    store = dist.HashStore()
    for r in range(2):
        store.add(liveness.key(r), 1)
    store.set(life_key(0), "0")
    store.set("hogwild/done/0", "1")  # group 0 finished its training and is gone
    life = group(store, 1, 1, rejoining=True, ngroups=2)
    assert life.rejoin(0.5) is False  # nobody answers the new life of group 1: group 0 has finished
    store.delete_key("hogwild/done/0")  # had it not finished, its state would be lost
    with pytest.raises(RuntimeError, match="no other group had state to give"):
        life.rejoin(0.5)
    life.lives.close()
