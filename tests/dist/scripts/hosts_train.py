"""A few DistOpt steps on a tiny model; each rank saves where it ran and its final parameters.

    mpiexec ... python hosts_train.py OUT      # or under any other launcher

Rank r starts from seed 100 + r (DistOpt must broadcast rank 0's) and trains on rows
[r*BATCH, (r+1)*BATCH) of each step's batch: the result equals `reference(world_size)`, one
process on the combined batch. OUT/rank{R}.pt holds the parameters, troupe.info() and the
host's addresses (which simulated host the rank ran on).
"""

import os
import socket
import sys

import torch
import torch.nn.functional as F
from torch import nn

STEPS, BATCH = 5, 8


def batches(world_size):
    g = torch.Generator().manual_seed(1234)
    return torch.randn(STEPS, world_size * BATCH, 8, generator=g), torch.randint(0, 4, (STEPS, world_size * BATCH),
                                                                                 generator=g)


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def reference(world_size):
    """One process, rank 0's initialisation, the whole batch: what every rank must end with."""
    model = make_model(100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = batches(world_size)
    for step in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(xs[step]), ys[step]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def main(out):
    import troupe
    from troupe.runtime import netif

    torch.set_num_threads(1)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    model = make_model(100 + rank)
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert opt.global_rank == rank, (opt.global_rank, rank)
    xs, ys = batches(opt.world_size)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    for step in range(STEPS):
        opt(F.cross_entropy(model(xs[step, rows]), ys[step, rows]))
    info = troupe.info()
    torch.save({"params": [p.detach() for p in model.parameters()], "world_size": info.world_size,
                "launcher": info.launcher, "local_rank": info.local_rank, "local_world_size": info.local_world_size,
                "hostname": socket.gethostname(), "addresses": sorted(netif.addresses().values()),
                "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
