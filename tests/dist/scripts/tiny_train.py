"""A few DistOpt steps on a tiny model; each rank saves its final parameters to OUT/rank{R}.pt.

    python tiny_train.py OUT                   # under troupe run, torchrun or mpiexec
    python tiny_train.py OUT --ticket N        # the multiprocessing + Ticket pattern, N ranks
"""

import multiprocessing
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import troupe


def train(out, ticket=None, local_rank=None, world_size=None):
    torch.set_num_threads(1)
    torch.manual_seed(os.getpid())  # a different init everywhere: DistOpt must broadcast rank 0's
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = troupe.DistOpt(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ticket=ticket, local_rank=local_rank, world_size=world_size
    )
    g = torch.Generator().manual_seed(opt.global_rank)
    for _ in range(5):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt(F.cross_entropy(model(x), y))
    info = troupe.info()
    torch.save(
        {"params": [p.detach() for p in model.parameters()], "world_size": opt.world_size, "launcher": info.launcher},
        os.path.join(out, f"rank{opt.global_rank}.pt"),
    )


if __name__ == "__main__":
    out = sys.argv[1]
    if len(sys.argv) > 2 and sys.argv[2] == "--ticket":
        ticket, n = troupe.Ticket(), int(sys.argv[3])
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=train, args=(out, ticket, r, n)) for r in range(n)]
        for p in procs:
            p.start()
        sys.exit(troupe.wait_all(procs))
    train(out)
