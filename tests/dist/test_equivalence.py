"""DistOpt on N ranks with batch b each == one process with batch N*b (plain torch, no troupe)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.world import run_world

STEPS = 20
BATCH = 8


class Net(nn.Module):
    """A small net with an optional branch (to exercise parameters without gradients)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 5)
        self.extra = nn.Linear(12, 5)  # used only when asked
        self.never = nn.Linear(3, 3)  # never used: must keep grad None, like one process

    def forward(self, x, use_extra=False):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out + self.extra(x) if use_extra else out


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01, weight_decay=1e-3)
    if name == "adadelta":
        return torch.optim.Adadelta(params, lr=1.0)
    raise ValueError(name)


def batches(world_size):
    g = torch.Generator().manual_seed(1234)
    xs = torch.randn(STEPS, world_size * BATCH, 12, generator=g)
    ys = torch.randint(0, 5, (STEPS, world_size * BATCH), generator=g)
    return xs, ys


def uses_extra(rank, step):
    return rank == 0 and step % 3 != 2


def train_distributed(rank, world_size, opt_name, bucket_size):
    import troupe

    torch.manual_seed(100 + rank)  # different init per rank: DistOpt must broadcast rank 0's
    model = Net()
    opt = troupe.DistOpt(make_optimizer(opt_name, model.parameters()), bucket_size=bucket_size)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=5, gamma=0.5)
    xs, ys = batches(world_size)
    for step in range(STEPS):
        sl = slice(rank * BATCH, (rank + 1) * BATCH)
        loss = F.cross_entropy(model(xs[step, sl], uses_extra(rank, step)), ys[step, sl])
        opt(loss)
        sched.step()
    assert model.never.weight.grad is None
    return {n: p.detach().clone() for n, p in model.named_parameters()}, len(opt.reducer.buckets)


def train_reference(world_size, opt_name):
    torch.manual_seed(100)  # rank 0's initialisation
    model = Net()
    opt = make_optimizer(opt_name, model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    xs, ys = batches(world_size)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        # Mean over the combined batch == average over ranks of each rank's mean loss.
        loss = sum(
            F.cross_entropy(
                model(xs[step, r * BATCH : (r + 1) * BATCH], uses_extra(r, step)), ys[step, r * BATCH : (r + 1) * BATCH]
            )
            for r in range(world_size)
        ) / world_size
        loss.backward()
        opt.step()
        sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "opt_name,world_size,bucket_size",
    [("sgd", 2, 50), ("adam", 2, 2**19), ("adadelta", 3, 40)],
)
def test_matches_single_process_combined_batch(opt_name, world_size, bucket_size):
    results = run_world(train_distributed, world_size, opt_name, bucket_size)
    expected = train_reference(world_size, opt_name)
    for params, nbuckets in results:
        if bucket_size < 200:
            assert nbuckets > 2  # the small bucket size really splits the model
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, atol=1e-5, rtol=1e-5, msg=f"parameter {name}")
    # and every rank holds bit-identical parameters
    for params, _ in results[1:]:
        for name in expected:
            assert torch.equal(params[name], results[0][0][name]), name
