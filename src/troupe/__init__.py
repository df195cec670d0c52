"""troupe: SINGA's distributed training for PyTorch, on torch.distributed.

>>> import troupe, torch
>>> sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9))
>>> loss = F.cross_entropy(model(x), y)
>>> loss.backward(); sgd.step(); sgd.zero_grad()   # the PyTorch loop
>>> model.set_optimizer(sgd)                       # or SINGA's: model is a troupe.Model
>>> out, loss = model.train_one_batch(x, y)
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from troupe.runtime import envrdv
from troupe.runtime.ticket import Ticket  # torch-free: a parent makes one before starting ranks

# Under mpiexec or in a Slurm step, the env:// variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT): a script that calls init_process_group() itself joins (runtime/envrdv.py).
envrdv.provide()
if "torch" in sys.modules:  # a cluster's DistributedSampler defaults (free once torch is loaded; else at DistOpt)
    from troupe.cluster import sampler as _sampler

    _sampler.install()

# Each other name is imported when first used (PEP 562): `troupe run`, `troupe plan` and the
# other commands start without importing torch, and a rank pays only for what it uses.
_WHERE = {
    "DIST_OPTIONS": "troupe.distopt",
    "Communicator": "troupe.runtime.comm",
    "CompressionConfig": "troupe.strategies.compressed",
    "DistInfo": "troupe.runtime.launch",
    "DistOpt": "troupe.distopt",
    "Model": "troupe.singa.model",
    "StepMismatchError": "troupe.sync.agree",
    "UpdateStrategy": "troupe.strategies.base",
    "World": "troupe.runtime.world",
    "cd": "troupe.algorithms",
    "checkpoint": "troupe.reliability",
    "clip_grad_norm_": "troupe.partition",
    "data": "troupe.script",
    "full_state_dict": "troupe.partition",
    "info": "troupe.runtime.world",
    "init": "troupe.runtime.world",
    "log": "troupe.script.scalars",
    "metrics": "troupe.script",
    "partition": "troupe",
    "shard": "troupe.sharding",
    "shutdown": "troupe.runtime.world",
    "track": "troupe.script.elastic",
    "wait_all": "troupe.runtime.spawn",
}

if TYPE_CHECKING:
    from troupe import partition
    from troupe.algorithms import cd
    from troupe.distopt import DIST_OPTIONS, DistOpt
    from troupe.partition import clip_grad_norm_, full_state_dict
    from troupe.reliability import checkpoint
    from troupe.runtime.comm import Communicator
    from troupe.runtime.launch import DistInfo
    from troupe.runtime.spawn import wait_all
    from troupe.runtime.world import World, info, init, shutdown
    from troupe.script import data, metrics
    from troupe.script.elastic import track
    from troupe.script.scalars import log
    from troupe.sharding import shard
    from troupe.singa.model import Model
    from troupe.strategies.base import UpdateStrategy
    from troupe.strategies.compressed import CompressionConfig
    from troupe.sync.agree import StepMismatchError


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'troupe' has no attribute {name!r}")
    if module == "troupe":  # a sub-package of troupe itself (partition): getattr would come back here
        value = importlib.import_module(f"troupe.{name}")
    else:
        parent = importlib.import_module(module)
        value = getattr(parent, name) if hasattr(parent, name) else importlib.import_module(f"{module}.{name}")
    globals()[name] = value
    if name in _CLIPS:
        from troupe.cluster import sampler
        from troupe.partition import torch_clip

        torch_clip.install()
        sampler.install()
    return value


_CLIPS = frozenset({"DistOpt", "Model", "clip_grad_norm_", "partition", "shard"})
"""Loading one of these makes torch.nn.utils.clip_grad_norm_ clip troupe's partitioned or sharded parameters as
troupe.clip_grad_norm_ does (troupe/partition/torch_clip.py), and a DistributedSampler made with its defaults count a
cluster's workers only (troupe/cluster/sampler.py)."""


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
    "shard",
    "shutdown",
    "track",
    "wait_all",
]
