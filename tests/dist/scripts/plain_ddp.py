"""A plain torch.distributed script (no troupe): DDP over env:// as torchrun would start it."""

import sys

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
sys.exit(0)
