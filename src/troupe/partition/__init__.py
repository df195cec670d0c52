"""Model, data and hybrid partition inside worker groups (SINGA 0.x's `partition_dim`).

A worker group of k consecutive ranks computes one model replica. Per nn.Linear /
nn.Conv2d layer: 0 splits the batch (data parallel), 1 splits the output features over
the group's workers, -1 runs the layer on the group's worker 0. Between layers every
worker holds its own samples with all features, so code between layers is unchanged.

This package owns the plan, the partitioned layers, the connection layers between them
and `full_state_dict`. It does not reduce gradients: DistOpt sums each parameter's
gradient over the ranks in its `_troupe_holders` and divides by the world size.

>>> model = troupe.partition(CNN(), {"conv*": 0, "linear*": 1}, workers_per_group=2)
>>> loss = F.cross_entropy(model(x_own), y_own)
>>> plain.load_state_dict(troupe.partition.full_state_dict(model))
"""

from __future__ import annotations

import sys
import types

from troupe.partition.clip import clip_grad_norm_
from troupe.partition.connect import WorkerGroup
from troupe.partition.layers import FeatureSplit, LayerSpec, OnOneWorker, PartitionedLayer
from troupe.partition.partitioner import HOLDERS, LayerInfo, describe, full_state_dict, partition
from troupe.partition.plan import PARTITION_DIMS, Plan, check_world, resolve_plan, slice_rows



class _Package(types.ModuleType):
    """This package, callable: ``troupe.partition(model, plan, k)`` is `partition` (the issue's
    spelling), while ``troupe.partition.full_state_dict`` and the rest stay reachable."""

    def __call__(self, *args, **kwargs):
        return partition(*args, **kwargs)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "HOLDERS",
    "PARTITION_DIMS",
    "FeatureSplit",
    "LayerInfo",
    "LayerSpec",
    "OnOneWorker",
    "PartitionedLayer",
    "Plan",
    "WorkerGroup",
    "check_world",
    "clip_grad_norm_",
    "describe",
    "full_state_dict",
    "partition",
    "resolve_plan",
    "slice_rows",
]
