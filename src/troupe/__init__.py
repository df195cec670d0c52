"""troupe: SINGA's distributed training for PyTorch, on torch.distributed.

>>> import troupe, torch
>>> sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9))
>>> loss = F.cross_entropy(model(x), y)
>>> loss.backward(); sgd.step(); sgd.zero_grad()   # the PyTorch loop
>>> model.set_optimizer(sgd)                       # or SINGA's: model is a troupe.Model
>>> out, loss = model.train_one_batch(x, y)
"""

from troupe import data, metrics, partition
from troupe.algorithms import cd
from troupe.partition import clip_grad_norm_, full_state_dict
from troupe.reliability import checkpoint
from troupe.runtime.comm import Communicator
from troupe.runtime.launch import DistInfo, Ticket, wait_all
from troupe.runtime.world import World, info, init, shutdown
from troupe.model import Model
from troupe.scalars import log
from troupe.distopt import DIST_OPTIONS, DistOpt
from troupe.strategies.base import UpdateStrategy
from troupe.strategies.compressed import CompressionConfig
from troupe.sync.agree import StepMismatchError

__version__ = "0.1.0"

__all__ = [
    "DIST_OPTIONS",
    "Communicator",
    "CompressionConfig",
    "DistInfo",
    "DistOpt",
    "Model",
    "StepMismatchError",
    "Ticket",
    "UpdateStrategy",
    "World",
    "cd",
    "checkpoint",
    "clip_grad_norm_",
    "data",
    "full_state_dict",
    "info",
    "init",
    "log",
    "metrics",
    "partition",
    "shutdown",
    "wait_all",
]
