"""Parameter-server clusters in real multi-process worlds (servers and workers over Gloo)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.world import run_world
from troupe.cluster import ClusterConfig

STEPS = 10
BATCH = 8


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batches(nworkers):
    g = torch.Generator().manual_seed(1234)
    return torch.randn(STEPS, nworkers * BATCH, 12, generator=g), torch.randint(0, 5, (STEPS, nworkers * BATCH), generator=g)


def make_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)


def train_in_cluster(rank, world_size, bucket_size):
    import troupe

    torch.manual_seed(100 + rank)  # different init per rank: worker 0's must win
    model = MLP()
    try:
        opt = troupe.DistOpt(make_sgd(model.parameters()), bucket_size=bucket_size)
    except SystemExit as e:  # a server rank serves inside DistOpt, then exits
        assert e.code == 0
        return "server"
    opt.sync_parameters(model)
    xs, ys = batches(opt.world_size)
    r = opt.global_rank
    for step in range(STEPS):
        loss = F.cross_entropy(model(xs[step, r * BATCH : (r + 1) * BATCH]), ys[step, r * BATCH : (r + 1) * BATCH])
        opt(loss)
    staleness = list(opt.ps.staleness)
    opt.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, staleness, opt.world_size


def train_reference(nworkers):
    torch.manual_seed(100)
    model = MLP()
    opt = make_sgd(model.parameters())
    xs, ys = batches(nworkers)
    for step in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(xs[step]), ys[step]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_sandblaster_one_group_equals_allreduce_step_for_step():
    cluster = ClusterConfig(nworkers_per_group=2, nservers_per_group=1, server_worker_separate=True)
    results = run_world(train_in_cluster, 3, 64, env={"TROUPE_CLUSTER": cluster.to_json()})
    assert results[2] == "server"
    expected = train_reference(2)
    for params, staleness, nworkers in results[:2]:
        assert nworkers == 2
        assert staleness == [0] * STEPS
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, atol=1e-5, rtol=1e-5, msg=f"parameter {name}")
