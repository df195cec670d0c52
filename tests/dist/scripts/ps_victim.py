"""Asynchronous training (Downpour, Hogwild) where worker 1 is killed mid-run (SIGKILL: no Stop, no clean exit)."""

from __future__ import annotations

import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

import troupe

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))
opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
opt.sync_parameters(model)
train_x, train_y, test_x, test_y = troupe.data.load_mnist()
x, y = troupe.data.partition(train_x[:4000], train_y[:4000], opt.global_rank, opt.world_size)
g = torch.Generator().manual_seed(opt.global_rank)
for step in range(120):
    if opt.global_rank == 1 and step == 10:
        os.kill(os.getpid(), signal.SIGKILL)  # between two updates: its group partner is left waiting
    idx = torch.randint(0, len(x), (32,), generator=g)
    opt(F.cross_entropy(model(x[idx]), y[idx]))
with torch.no_grad():
    acc = (model(test_x[:1000]).argmax(1) == test_y[:1000]).float().mean().item()
print(f"worker {opt.global_rank} accuracy {acc:.4f}", flush=True)
