"""troupe.data.DistributedSampler and loader without processes: every rank's share computed side by side."""

from __future__ import annotations

import itertools

import pytest
import torch

from torch.utils.data import TensorDataset

from troupe.script.data import DistributedSampler, loader

SIZES = [1, 2, 7, 10, 12, 13, 101]
WORLDS = [1, 2, 3, 4, 8]


def shares(size, world_size, **kw):
    return [DistributedSampler(size, rank=r, world_size=world_size, **kw) for r in range(world_size)]


def lists(samplers, epoch=0):
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers]


@pytest.mark.parametrize("size,world_size", list(itertools.product(SIZES, WORLDS)))
def test_uneven_sees_every_sample_exactly_once_per_epoch(size, world_size):
    samplers = shares(size, world_size, tail="uneven")
    for epoch in range(3):
        got = lists(samplers, epoch)
        assert sorted(i for part in got for i in part) == list(range(size))
        assert [len(p) for p in got] == [len(s) for s in samplers] == [s.num_samples for s in samplers]
        assert max(map(len, got)) - min(map(len, got)) <= 1
        # the first size % world_size ranks carry the extra sample
        assert [len(p) for p in got] == [size // world_size + (r < size % world_size) for r in range(world_size)]


@pytest.mark.parametrize("size,world_size,tail", [
    (n, w, tail) for n, w in itertools.product(SIZES, WORLDS) for tail in ("pad", "drop")
    if not (tail == "drop" and n < w)  # an error, tested below
])
def test_pad_and_drop_give_equal_disjoint_shares_and_match_torch(size, world_size, tail):
    samplers = shares(size, world_size, tail=tail, seed=5)
    for epoch in (0, 3):
        got = lists(samplers, epoch)
        n = -(-size // world_size) if tail == "pad" else size // world_size
        assert [len(p) for p in got] == [n] * world_size == [len(s) for s in samplers]
        flat = [i for part in got for i in part]
        if tail == "drop":
            assert len(set(flat)) == len(flat) == n * world_size  # disjoint: nothing repeats
        else:
            assert set(flat) == set(range(size))  # complete; only the padding repeats
            assert len(flat) - size == n * world_size - size
        for r, part in enumerate(got):
            ref = torch.utils.data.DistributedSampler(range(size), num_replicas=world_size, rank=r, seed=5,
                                                      drop_last=tail == "drop")
            ref.set_epoch(epoch)
            assert part == list(ref)


def test_the_permutation_is_the_same_on_every_rank_and_changes_with_the_epoch():
    a, b = shares(1000, 4, tail="uneven", seed=3)[:2]
    assert a.global_indices(2) == b.global_indices(2)  # every rank draws the same permutation
    assert a.global_indices(0) != a.global_indices(1)  # reshuffled between epochs
    assert sorted(a.global_indices(1)) == list(range(1000))
    assert DistributedSampler(1000, rank=0, world_size=4, seed=4).global_indices(0) != a.global_indices(0)
    first = lists([a], 0)[0]
    assert lists([a], 1)[0] != first and lists([a], 0)[0] == first  # deterministic per (seed, epoch)


def test_no_shuffle_interleaves_in_order():
    assert lists(shares(10, 3, shuffle=False, tail="uneven")) == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert lists(shares(10, 3, shuffle=False, tail="pad")) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert lists(shares(10, 3, shuffle=False, tail="drop")) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    # pad on a dataset smaller than the world: samples repeat more than once
    assert lists(shares(2, 5, shuffle=False)) == [[0], [1], [0], [1], [0]]


def test_a_dataset_or_its_length():
    data = torch.utils.data.TensorDataset(torch.arange(9))
    assert list(DistributedSampler(data, rank=1, world_size=2)) == list(DistributedSampler(9, rank=1, world_size=2))


def test_state_dict_resumes_mid_epoch():
    s = DistributedSampler(50, rank=1, world_size=3, seed=7, tail="uneven")
    s.set_epoch(2)
    whole = list(s)
    it = iter(s)
    head = [next(it) for _ in range(6)]
    state = s.state_dict()
    assert state["epoch"] == 2 and state["consumed"] == 6

    fresh = DistributedSampler(50, rank=1, world_size=3, seed=7, tail="uneven")
    fresh.load_state_dict(state)
    fresh.set_epoch(2)  # the loop's own set_epoch for the resumed epoch keeps the position
    assert len(fresh) == len(whole) - 6
    assert head + list(fresh) == whole
    assert len(fresh) == len(whole) and list(fresh) == whole  # the next iteration is a whole epoch again
    fresh.set_epoch(3)
    assert list(fresh) == s.indices(3)


def test_state_dict_through_a_dataloader_and_an_explicit_count():
    x = torch.arange(40)
    train = loader((x, x * 2), 4, rank=0, world_size=2, seed=1, tail="drop")
    train.sampler.set_epoch(1)
    whole = [b[0].tolist() for b in train]
    batches = iter(train)
    done = [next(batches)[0].tolist() for _ in range(3)]
    state = train.sampler.state_dict()
    assert state["consumed"] == 12  # num_workers=0: the loader took exactly what was trained on
    assert train.sampler.state_dict(consumed=8)["consumed"] == 8

    again = loader((x, x * 2), 4, rank=0, world_size=2, seed=1, tail="drop")
    again.sampler.load_state_dict(state)
    again.sampler.set_epoch(1)
    assert len(again) == len(whole) - 3
    assert done + [b[0].tolist() for b in again] == whole


def test_state_from_another_setup_is_refused():
    state = DistributedSampler(50, rank=0, world_size=2).state_dict()
    # Another world size is not another setup: the position reshards (tests below).
    DistributedSampler(50, rank=0, world_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="size=50"):
        DistributedSampler(49, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="consumed 26"):
        DistributedSampler(50, rank=0, world_size=2).load_state_dict({"epoch": 0, "consumed": 26})


def resume_through(size, worlds, steps, tail, batch=3, epoch=1, seed=9):
    """The indices each world hands out in one epoch of a run checkpointed and resumed on each world size of
    `worlds` in turn: world k takes `steps[k]` batches per rank (None: to the end of the epoch), then one
    rank's state (a different rank each time) goes to the next world."""
    seen, state = [], None
    for k, (world_size, n_steps) in enumerate(zip(worlds, steps)):
        samplers = shares(size, world_size, tail=tail, seed=seed)
        loaders = []
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
            s.set_epoch(epoch)  # the loop's own call for the resumed epoch keeps the position
            loaders.append(torch.utils.data.DataLoader(range(size), batch_size=batch, sampler=s))
        batches = [iter(dl) for dl in loaders]
        seen.append([])
        for _ in range(n_steps if n_steps is not None else max(map(len, loaders))):
            for it in batches:  # a synchronous loop: one batch per rank per step, until a rank runs out
                seen[-1] += next(it, torch.tensor([], dtype=torch.long)).tolist()
        state = samplers[k % world_size].state_dict()
        assert all(s.state_dict()["position"] == state["position"] for s in samplers)
    return seen


@pytest.mark.parametrize("worlds,steps", [
    ((4, 2), (3, None)), ((2, 3), (5, None)), ((4, 2, 3), (2, 3, None)), ((3, 3), (4, None)),
    ((1, 4, 2), (7, 1, None)), ((4, 2), (0, None)), ((2, 4), (17, None)),  # 17 steps: the first epoch ends
])
@pytest.mark.parametrize("size", [101, 24])
def test_a_resumed_epoch_reshards_to_any_world_size(worlds, steps, size):
    # The epoch's permutation, computed here as torch's DistributedSampler defines it (seed + epoch)
    permutation = torch.randperm(size, generator=torch.Generator().manual_seed(9 + 1)).tolist()
    per_world = resume_through(size, worlds, steps, "uneven")
    uneven = [i for part in per_world for i in part]
    assert sorted(uneven) == list(range(size))  # every sample exactly once across the worlds
    start = 0
    for part in per_world:  # and each world took the next stretch of the permutation
        assert sorted(part) == sorted(permutation[start:start + len(part)])
        start += len(part)
    last = worlds[-1]
    pad = [i for part in resume_through(size, worlds, steps, "pad") for i in part]
    assert set(pad) == set(range(size)) and len(pad) - size < last  # only the last world's padding repeats
    drop = [i for part in resume_through(size, worlds, steps, "drop") for i in part]
    assert len(set(drop)) == len(drop) and size - len(drop) < last  # nothing repeats; only its tail is left out


@pytest.mark.parametrize("tail", ["uneven", "pad", "drop"])
def test_the_same_world_size_resumes_exactly_the_uninterrupted_run(tail):
    for world_size in (1, 3, 4):
        whole = [s.indices(1) for s in shares(101, world_size, tail=tail, seed=9)]
        both = [i for part in resume_through(101, (world_size, world_size), (2, None), tail) for i in part]
        flat = [i for j in range(len(whole[0])) for part in whole for i in part[j * 3: j * 3 + 3]]
        assert both == flat


def test_a_state_from_before_positions_resumes():
    s = DistributedSampler(50, rank=1, world_size=2, tail="uneven")
    s.set_epoch(3)
    it = iter(s)
    head = [next(it) for _ in range(4)]
    old = {k: v for k, v in s.state_dict().items() if k != "position"}  # consumed per rank, as before
    fresh = DistributedSampler(50, rank=1, world_size=2, tail="uneven")
    fresh.load_state_dict(old)
    assert head + list(fresh) == s.indices(3)
    with pytest.raises(ValueError, match="position 51 is past the end"):
        fresh.load_state_dict({**old, "position": 51})
    fresh.load_state_dict({**old, "position": 34})  # 16 left: 8 for each of the 2 ranks
    iter(fresh)
    with pytest.raises(ValueError, match="consumed 9 is more than this rank's 8 samples left"):
        fresh.state_dict(consumed=9)


def test_loader_batches_this_ranks_share_of_tensors():
    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    parts = [loader((x, y), 3, rank=r, world_size=2, tail="uneven", shuffle=False) for r in range(2)]
    assert [[yb.tolist() for _, yb in p] for p in parts] == [[[0, 2, 4], [6, 8]], [[1, 3, 5], [7, 9]]]
    xb, _ = next(iter(parts[0]))
    assert xb.shape == (3, 1)
    assert isinstance(parts[0].sampler, DistributedSampler)
    single = loader(torch.arange(6), 6, rank=0, world_size=1, shuffle=False, drop_last=True)
    assert [b[0].tolist() for b in single] == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(rank=0, world_size=0), ValueError, "world_size must be >= 1"),
    (dict(rank=2, world_size=2), ValueError, "rank 2 is out of range for world_size 2"),
    (dict(rank=-1, world_size=2), ValueError, "rank must be >= 0"),
    (dict(rank=0), ValueError, "both rank and world_size"),
    (dict(rank=0, world_size=2, tail="last"), ValueError, "tail must be one of"),
    (dict(rank=0, world_size=20, tail="drop"), ValueError, "fewer than world_size 20"),
    (dict(rank=0, world_size=2.0), TypeError, "world_size must be an int"),
])
def test_bad_sampler_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedSampler(10, **kwargs)


def test_bad_datasets_and_loader_arguments():
    with pytest.raises(ValueError, match="empty"):
        DistributedSampler(0, rank=0, world_size=1)
    with pytest.raises(TypeError, match="sized dataset or an int"):
        DistributedSampler(3.5, rank=0, world_size=1)
    with pytest.raises(TypeError, match="epoch must be an int"):
        DistributedSampler(4, rank=0, world_size=1).set_epoch("1")
    with pytest.raises(ValueError, match="share their first dimension"):
        loader((torch.zeros(4, 2), torch.zeros(5)), 2, rank=0, world_size=1)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        loader(torch.zeros(4), 0, rank=0, world_size=1)
    with pytest.raises(TypeError, match="do not pass sampler"):
        loader(torch.zeros(4), 2, rank=0, world_size=1, sampler=None)
    with pytest.raises(TypeError, match="map-style dataset"):
        loader(iter([1, 2]), 2, rank=0, world_size=1)


def fake_world(monkeypatch, cluster, split):
    from types import SimpleNamespace

    from troupe.runtime import world as world_mod

    job = SimpleNamespace(rank=4, world_size=5)
    comm = SimpleNamespace(rank=1, world_size=3) if split else job
    from troupe.runtime.elastic import Fixed

    world = SimpleNamespace(settings=SimpleNamespace(cluster=cluster), job=job, comm=comm, membership=Fixed())
    monkeypatch.setattr(world_mod, "init", lambda: world)


def test_rank_and_world_size_default_to_the_data_parallel_communicator(monkeypatch):
    fake_world(monkeypatch, "downpour", split=True)  # a cluster's workers, after the DistOpt
    s = DistributedSampler(30)
    assert (s.rank, s.world_size) == (1, 3)
    fake_world(monkeypatch, None, split=False)  # plain data parallelism (and troupe.partition): the job
    assert (DistributedSampler(30).rank, DistributedSampler(30).world_size) == (4, 5)


def test_a_cluster_sampler_made_before_the_distopt_is_refused(monkeypatch):
    fake_world(monkeypatch, "downpour", split=False)
    with pytest.raises(RuntimeError, match="after the DistOpt"):
        DistributedSampler(30)


@pytest.mark.parametrize("groups,members", [(3, (0, 2)), (4, (1,)), (5, (0, 3)), (4, (0, 1, 2, 3)), (6, (1, 2, 5))])
def test_under_a_constant_batch_each_groups_batch_is_taken_once(groups, members):
    """Quorum.covered_by deals the missing groups out: every batch of the job taken by one member."""
    from troupe.runtime.quorum import Quorum

    q = Quorum(1, members)
    taken = [g for m in members for g in q.covered_by(m, groups)]
    assert sorted(taken) == list(range(groups))
    assert [q.covered_by(m, groups)[0] for m in members] == list(members)  # each its own first
    sizes = [len(q.covered_by(m, groups)) for m in members]
    assert max(sizes) - min(sizes) <= 1


def test_step_batches_hold_the_covered_ranks_batches_drawn_per_step():
    """StepBatches: rank 0's batch b holds its own batch b, then batch b of each rank named at that
    draw; the sampler's position counts only its own indices (a joiner resumes from it)."""
    from troupe.script.sampling import StepBatches

    world, bs = 3, 4
    samplers = shares(40, world, tail="drop", seed=5)
    own = [[s.indices(0)[b * bs:(b + 1) * bs] for b in range(3)] for s in samplers]
    who = iter([(0,), (0, 1), (0, 2, 1)])
    batches = StepBatches(samplers[0], bs, True, lambda: next(who))
    assert len(batches) == len(samplers[0]) // bs == 3
    got = list(batches)
    assert got == [own[0][0], own[0][1] + own[1][1], own[0][2] + own[2][2] + own[1][2]]
    assert samplers[0].state_dict()["position"] == 3 * bs * world
    with pytest.raises(ValueError, match="must start with this sampler's rank 0"):
        next(iter(StepBatches(samplers[0], bs, True, lambda: (1, 0))))


def test_constant_batch_weight_and_its_errors(monkeypatch):
    """A rank whose batch holds k of the job's G batches weighs k * present / G in the quorum's mean;
    a batch not drawn by troupe's loader for this step, or workers drawing ahead, are refused."""
    from troupe.runtime.elastic import Elastic
    from troupe.runtime.quorum import ElasticOptions, Quorum
    from troupe.script import sampling

    m = Elastic.__new__(Elastic)  # its store and heartbeat are not needed here
    m.options, m.rank, m.group, m.place = ElasticOptions(groups=3, batch="constant"), 0, 0, 0
    m.quorum, m.round, m._drawn, m._weighed = Quorum(2, (0, 2)), 4, None, False
    with pytest.raises(RuntimeError, match="was not drawn by troupe.data.loader"):
        m.grad_weight()
    assert m.batch_ranks() == (0, 1)
    assert m.grad_weight() == pytest.approx(2 * 2 / 3)
    m.round += 1  # the next step: its batch must be drawn again
    with pytest.raises(RuntimeError, match="was not drawn"):
        m.grad_weight()
    monkeypatch.setattr(sampling, "_constant_batch_membership", lambda: m)
    monkeypatch.setattr(sampling, "_data_parallel_place", lambda rank, world_size: (0, 3))
    data = sampling.loader(torch.zeros(12, 2), 2, num_workers=2)  # workers read the own batches ahead
    assert isinstance(data, sampling.StepLoader) and isinstance(data.batch_sampler, sampling.OwnBatches)
    assert isinstance(data.sampler, DistributedSampler) and data.ranks == m.batch_ranks
    data = sampling.loader(torch.zeros(12, 2), 2, drop_last=True)
    assert isinstance(data.sampler, DistributedSampler) and isinstance(data.batch_sampler, sampling.StepBatches)


def test_step_loader_with_workers_gives_the_batches_and_position_of_the_loader_without():
    """`StepLoader` (num_workers=2: the own batches read ahead by workers, the missing groups' read in the
    loop's process) hands out exactly what `StepBatches` (num_workers=0) does for the same groups per step,
    and its sampler is where the other's is after each batch (a joiner resumes from it), the resumed epoch
    and the tail included."""
    from torch.utils.data import DataLoader

    from troupe.script.sampling import OwnBatches, StepBatches, StepLoader

    world, bs = 3, 4
    x, y = torch.arange(50.0).repeat_interleave(2).view(50, 2), torch.arange(50)
    dataset = TensorDataset(x, y)
    who = [(0,), (0, 1), (0, 2, 1), (0,), (0, 2)]
    for drop_last, resume in ((True, 0), (False, 9)):
        a, b = (shares(50, world, seed=3)[0] for _ in range(2))
        for s in (a, b):
            s.load_state_dict({**s.state_dict(), "position": resume})
        plain = DataLoader(dataset, batch_sampler=StepBatches(a, bs, drop_last, iter(who).__next__))
        ahead = StepLoader(dataset, iter(who).__next__, batch_sampler=OwnBatches(b, bs, drop_last), num_workers=2,
                           prefetch_factor=2)
        assert len(plain) == len(ahead)
        for k, ((xa, ya), (xb, yb)) in enumerate(zip(plain, ahead, strict=True)):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
            assert a.state_dict() == b.state_dict()
            assert len(ya) == bs * len(who[k]) or not drop_last  # (a resumed epoch once ran one batch too many)
        assert a.state_dict()["position"] == b.state_dict()["position"] > resume


def test_collated_batches_are_joined_sample_after_sample_or_refused_in_one_line():
    from collections import namedtuple

    from troupe.script.sampling import concat_batches

    Pair = namedtuple("Pair", "x y")
    first = {"x": torch.zeros(2, 3), "names": ["a", "b"], "pair": Pair(torch.ones(2), (torch.zeros(2),))}
    second = {"x": torch.ones(1, 3), "names": ["c"], "pair": Pair(torch.zeros(1), (torch.ones(1),))}
    joined = concat_batches(first, second)
    assert joined["x"].shape == (3, 3) and joined["names"] == ["a", "b", "c"]
    assert isinstance(joined["pair"], Pair) and joined["pair"].x.tolist() == [1, 1, 0]
    assert joined["pair"].y[0].tolist() == [0, 0, 1]
    with pytest.raises(TypeError, match="cannot join two collated batches of type int"):
        concat_batches(3, 4)
