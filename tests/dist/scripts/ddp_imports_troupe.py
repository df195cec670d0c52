"""A DDP-shaped script that imports troupe and calls init_process_group() itself (env://), under any launcher."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import troupe  # noqa: F401  (under mpiexec or srun: torch's env:// variables, as torchrun sets them)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert os.environ["LOCAL_RANK"] == str(rank), os.environ["LOCAL_RANK"]  # one host: local rank = rank
torch.manual_seed(0)
model = DDP(torch.nn.Linear(3, 1))
model(torch.full((2, 3), float(rank + 1))).sum().backward()
expected = 2 * sum(r + 1 for r in range(world)) / world  # the mean of the ranks' 2 * (rank + 1)
assert torch.allclose(model.module.weight.grad, torch.full((1, 3), expected)), model.module.weight.grad
print(f"ddp rank {rank} of {world} ok", flush=True)
dist.destroy_process_group()
os._exit(0)  # not sys.exit: torch's Gloo exit abort (pytorch/pytorch#179291), as in plain_ddp.py
