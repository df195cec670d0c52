"""A plain torch.distributed script (no troupe): DDP over env:// as torchrun would start it."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the launcher
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(3, 1))
model(torch.full((2, 3), float(rank + 1))).sum().backward()
# each rank's gradient of the weight is 2 * (rank + 1): DDP leaves their mean on every rank
expected = 2 * sum(r + 1 for r in range(world)) / world
assert torch.allclose(model.module.weight.grad, torch.full((1, 3), expected)), model.module.weight.grad
print(f"plain ddp rank {rank} of {world} ok", flush=True)
dist.destroy_process_group()
# Not sys.exit: a Gloo worker thread can free its last work (which holds a Python object) while
# the interpreter finalizes, a SIGABRT at exit ("terminate called without an active exception";
# 1 run in 20 here, under torchrun as under troupe run, with or without `del model` first; torch's
# own bug, pytorch/pytorch#179291). This script tests the launcher's variables, not torch's exit.
os._exit(0)
