"""dist_option "powerSGD" on 2 ranks against torch's own ``powerSGD_hook`` under DDP, in the same world.

Both train copies of one model (same initial weights, SGD with momentum) on the same
per-rank batches, every bucket in one (both caps large), torch's Q seeded by its
``random_seed`` 0 and troupe's by the same rule. Steps 0-1 are plain (torch's DDP needs
``start_powerSGD_iter`` >= 2), then PowerSGD with error feedback and warm start; step 4
accumulates two micro-batches under ``no_sync``. The parameters must agree within 1e-5
after every step, for rank 2 (Gram-Schmidt) and rank 3 (QR); troupe through the PyTorch
loop for one, SINGA's ``update(loss, "powerSGD")`` for the other. A checkpoint taken after
step 3 and loaded into a fresh DistOpt continues exactly as the uninterrupted run.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tests.dist.world import run_world

STEPS, START, ACCUM_STEP = 6, 2, 4


def model() -> nn.Module:
    """A conv weight (8 x 18, compressed), a 16 x 128 matrix (compressed), a 4 x 16 one (too small to
    compress at rank 2: it travels whole) and biases (vectors: whole)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(128, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    return torch.randn(8, 2, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)


def loss_of(net: nn.Module, rank: int, step: int, micro: int = 0) -> torch.Tensor:
    x, y = batch(rank, step, micro)
    return nn.functional.cross_entropy(net(x), y)


def flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def train_torch(rank: int, powersgd_rank: int) -> list[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(model(), bucket_cap_mb=1000)  # the model has no buffers
    net.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=powersgd_rank,
                                         start_powerSGD_iter=START, random_seed=0), powerSGD_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step in range(STEPS):
        if step == ACCUM_STEP:
            with net.no_sync():
                loss_of(net, rank, step, 1).backward()
        loss_of(net, rank, step).backward()
        opt.step()
        opt.zero_grad()
        history.append(flat(net))
    return history


def troupe_sgd(net: nn.Module, powersgd_rank: int):
    import troupe

    sgd = troupe.DistOpt(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), dist_option="powerSGD",
                         powersgd_rank=powersgd_rank, powersgd_start=START, bucket_size=10**6,
                         first_bucket_size=10**6)
    sgd.sync_parameters(net)
    return sgd


def troupe_step(sgd, net: nn.Module, rank: int, step: int, loop: str) -> None:
    if step == ACCUM_STEP:
        sgd.zero_grad()  # SINGA's update leaves its step's gradients until its next call
        with sgd.no_sync():
            loss_of(net, rank, step, 1).backward()
    if loop == "torch" or step == ACCUM_STEP:  # SINGA's update zeroes the gradients first: no accumulation
        loss_of(net, rank, step).backward()
        sgd.step()
        sgd.zero_grad()
    else:
        sgd.update(loss_of(net, rank, step), "powerSGD")


def train_troupe(rank: int, powersgd_rank: int, loop: str) -> dict:
    net = model()
    sgd = troupe_sgd(net, powersgd_rank)
    history, stats = [], []
    for step in range(STEPS):
        troupe_step(sgd, net, rank, step, loop)
        history.append(flat(net))
        stats.append(dict(sgd.last_step_stats))
        if step == 3:
            # deep copies: torch's optimizer state_dict holds the live momentum buffers
            saved = copy.deepcopy({"model": net.state_dict(), "sgd": sgd.state_dict()})
    # resume from the checkpoint after step 3 in a fresh DistOpt
    net2 = model()
    net2.load_state_dict(saved["model"])
    sgd2 = troupe_sgd(net2, powersgd_rank)
    sgd2.load_state_dict(saved["sgd"])
    resumed = []
    for step in range(4, STEPS):
        troupe_step(sgd2, net2, rank, step, loop)
        resumed.append(flat(net2))
    return {"history": history, "stats": stats, "resumed": resumed, "state": saved["sgd"]["strategies"]}


def world(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for powersgd_rank, loop in ((2, "torch"), (3, "singa")):
        mine = train_troupe(rank, powersgd_rank, loop)  # first: troupe's DistOpt sets up the process group
        out[powersgd_rank] = {"torch": train_torch(rank, powersgd_rank), **mine}
    return out


def test_powersgd_equals_torchs_hook_under_ddp():
    results = run_world(world, 2, timeout=60)
    for powersgd_rank in (2, 3):
        for rank in (0, 1):
            got = results[rank][powersgd_rank]
            for step, (a, b) in enumerate(zip(got["history"], got["torch"])):
                diff = (a - b).abs().max().item()
                assert diff < 1e-5, f"rank {powersgd_rank}, process {rank}, step {step}: max |troupe - torch| {diff}"
            for step, (a, b) in enumerate(zip(got["resumed"], got["history"][4:]), start=4):
                assert torch.equal(a, b), f"rank {powersgd_rank}: the resumed run differs at step {step}"
            stats = got["stats"]
            assert [s["compressed"] for s in stats] == [False] * START + [True] * (STEPS - START)
            assert stats[-1]["ratio"] < 0.5, stats[-1]
            state = got["state"]
            assert set(state["residuals"]) == {"powerSGD/bucket0"} and state["powerSGD"]["draws"] == 1
        # the ranks end equal, and compression changed the result (PowerSGD is not the plain mean)
        assert torch.equal(results[0][powersgd_rank]["history"][-1], results[1][powersgd_rank]["history"][-1])
    assert not torch.allclose(results[0][2]["history"][-1], results[0][3]["history"][-1], atol=1e-4)
