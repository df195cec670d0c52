"""Five DistOpt steps on a tiny model with one dist_option: python tiny_option.py OPTION [SPARS]."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import troupe

if __name__ == "__main__":
    option = sys.argv[1]
    spars = float(sys.argv[2]) if len(sys.argv) > 2 else None
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(opt.global_rank)
    for _ in range(5):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.update(F.cross_entropy(model(x), y), option, spars)
