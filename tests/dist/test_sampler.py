"""troupe.data.DistributedSampler / loader and troupe.log in a real 2-rank world: shares from the World,
uneven tails finished with DistOpt.join() (equal to one process), user scalars in TensorBoard."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.world import run_world

N, BATCH, EPOCHS = 9, 2, 2  # 2 ranks, tail="uneven": rank 0 gets 5 samples (3 batches), rank 1 gets 4 (2)


def dataset():
    g = torch.Generator().manual_seed(11)
    return torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)


def make_model():
    torch.manual_seed(3)
    return nn.Linear(4, 3)


def _in_a_world(rank, world_size):
    import troupe

    shares = {}
    for tail in ("uneven", "pad", "drop"):
        s = troupe.data.DistributedSampler(101, tail=tail, seed=4)  # rank and world size from the World
        assert (s.rank, s.world_size) == (rank, world_size)
        shares[tail] = []
        for epoch in range(2):
            s.set_epoch(epoch)
            shares[tail].append((list(s), s.global_indices()))

    model = make_model()
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    train = troupe.data.loader(dataset(), BATCH, tail="uneven", seed=1)
    batches = []
    for epoch in range(EPOCHS):
        train.sampler.set_epoch(epoch)
        with sgd.join():  # rank 1 runs out of batches first; it shadows rank 0's last step
            for x, y in train:
                F.cross_entropy(model(x), y).backward()
                sgd.step()
                sgd.zero_grad()
                batches.append(len(y))
        troupe.log({"train/epoch": float(epoch), "rank": torch.tensor(float(rank))}, epoch)
    troupe.log({"every/rank": rank}, 7, all_ranks=True)
    steps = sgd.step_count
    troupe.shutdown()  # flush the event files before the parent reads them
    return shares, [p.detach() for p in model.parameters()], steps, batches


def reference():
    """One process: step k averages the mean losses of the ranks that still have a k-th batch."""
    import troupe

    x, y = dataset()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loaders = [troupe.data.loader((x, y), BATCH, tail="uneven", seed=1, rank=r, world_size=2) for r in (0, 1)]
    for epoch in range(EPOCHS):
        per_rank = []
        for train in loaders:
            train.sampler.set_epoch(epoch)
            per_rank.append(list(train))
        for k in range(max(map(len, per_rank))):
            active = [b[k] for b in per_rank if k < len(b)]
            opt.zero_grad()
            (sum(F.cross_entropy(model(bx), by) for bx, by in active) / len(active)).backward()
            opt.step()
    return list(model.parameters())


def test_shares_uneven_training_with_join_and_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the test extra has it)")
    board = tmp_path / "tb"
    results = run_world(_in_a_world, 2, timeout=120, env={"TROUPE_TENSORBOARD": str(board)})

    for tail in ("uneven", "pad", "drop"):
        for epoch in range(2):
            (mine0, perm0), (mine1, perm1) = (r[0][tail][epoch] for r in results)
            assert perm0 == perm1  # one permutation, drawn independently on every rank
            if tail == "uneven":
                assert sorted(mine0 + mine1) == list(range(101)) and (len(mine0), len(mine1)) == (51, 50)
            else:
                assert len(mine0) == len(mine1) == (51 if tail == "pad" else 50)
                assert len(set(mine0) & set(mine1)) == (1 if tail == "pad" else 0)  # pad repeats one sample
        assert results[0][0][tail][0][1] != results[0][0][tail][1][1]  # reshuffled

    want = reference()
    for _, params, steps, batches in results:
        assert steps == EPOCHS * 3  # rank 1 stepped along with rank 0's third batch
        for got, ref in zip(params, want):
            torch.testing.assert_close(got, ref.detach(), atol=1e-6, rtol=1e-5)
    assert results[0][3] == [2, 2, 1] * EPOCHS and results[1][3] == [2, 2] * EPOCHS
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))

    from tests.unit.test_tensorboard import read_scalars

    rank0, rank1 = read_scalars(board / "rank0"), read_scalars(board / "rank1")
    assert rank0["train/epoch"] == [(0, 0.0), (1, 1.0)] and rank0["rank"] == [(0, 0.0), (1, 0.0)]
    assert "train/epoch" not in rank1 and "rank" not in rank1  # rank 0 only, by default
    assert rank0["every/rank"] == [(7, 0.0)] and rank1["every/rank"] == [(7, 1.0)]
    assert "time/step_ms" in rank0 and "time/step_ms" in rank1  # beside troupe's own step stats
