"""Partitioned layers: what replaces an nn.Linear or nn.Conv2d with partition_dim 1 or -1.

Each keeps the original's parameter names (`weight`, `bias`), so `fc1.weight` stays
`fc1.weight` for optimizers and checkpoints, and takes and returns activations in the
layout at module boundaries: this worker's own samples, all features. The exchanges in
between live in connect.py; how a partition's gradients are reduced is DistOpt's business
(each parameter's `_troupe_holders`, set by the partitioner).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from troupe.partition.connect import WorkerGroup, from_root, gather_batch, to_owners, to_root
from troupe.partition.plan import slice_rows

_PARAMS = ("weight", "bias")


@dataclass(frozen=True)
class LayerSpec:
    """How one nn.Linear or nn.Conv2d computes, from weight and bias passed in (holds no tensors)."""

    kind: Literal["Linear", "Conv2d"]
    in_size: int
    out_size: int
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] | str = ()
    dilation: tuple[int, ...] = ()
    groups: int = 1
    padding_mode: str = "zeros"
    reversed_padding: tuple[int, ...] = ()
    """What nn.Conv2d pads by hand when padding_mode is not "zeros"."""

    @classmethod
    def of(cls, layer: nn.Linear | nn.Conv2d) -> LayerSpec:
        if isinstance(layer, nn.Linear):
            return cls("Linear", layer.in_features, layer.out_features)
        return cls("Conv2d", layer.in_channels, layer.out_channels, tuple(layer.stride), layer.padding,
                   tuple(layer.dilation), layer.groups, layer.padding_mode,
                   tuple(layer._reversed_padding_repeated_twice))

    @property
    def feature_dim(self) -> int:
        """The dimension of an activation that holds this layer's output features."""
        return -1 if self.kind == "Linear" else 1

    def apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The layer's forward on `x` with these parameters (what nn.Linear / nn.Conv2d compute)."""
        if x.dim() < (2 if self.kind == "Linear" else 4):
            raise ValueError(f"a partitioned {self.kind} needs batched input (batch dimension first), "
                             f"got shape {tuple(x.shape)}")
        if self.kind == "Linear":
            return F.linear(x, weight, bias)
        padding = self.padding
        if self.padding_mode != "zeros":
            x, padding = F.pad(x, self.reversed_padding, mode=self.padding_mode), 0
        return F.conv2d(x, weight, bias, self.stride, padding, self.dilation, self.groups)

    def describe(self) -> str:
        return f"{self.kind}({self.in_size}, {self.out_size})"


class PartitionedLayer(nn.Module):
    """What a partitioned layer has in common: its spec, its group, its dim."""

    partition_dim: int

    def __init__(self, layer: nn.Linear | nn.Conv2d, group: WorkerGroup):
        super().__init__()
        self.spec = LayerSpec.of(layer)
        self.group = group
        self.workers_per_group = group.workers_per_group
        self._whole = {name: (tuple(p.shape), p.dtype, p.device)
                       for name in _PARAMS if (p := getattr(layer, name)) is not None}

    @property
    def kind(self) -> str:
        """The type of the layer it replaced ("Linear" or "Conv2d")."""
        return self.spec.kind

    def full_tensors(self) -> dict[str, Tensor]:
        """The whole layer's parameters on every worker of the group (a collective)."""
        raise NotImplementedError


class FeatureSplit(PartitionedLayer):
    """partition_dim 1: worker j holds slice j of the output features (rows of weight and bias)
    and computes them for the whole group's batch."""

    partition_dim = 1

    def __init__(self, layer: nn.Linear | nn.Conv2d, group: WorkerGroup):
        super().__init__(layer, group)
        rows = slice_rows(self.spec.out_size, group.workers_per_group, group.index)
        for name in _PARAMS:
            whole = getattr(layer, name)
            # clone: a view would keep the whole tensor's storage alive
            part = None if whole is None else nn.Parameter(whole.detach()[rows].clone(), whole.requires_grad)
            self.register_parameter(name, part)

    def forward(self, x: Tensor) -> Tensor:
        y = self.spec.apply(gather_batch(x, self.group), self.weight, self.bias)
        return to_owners(y, self.group, self.spec.feature_dim)

    def full_tensors(self) -> dict[str, Tensor]:
        k, out = self.workers_per_group, {}
        for name, (shape, _, _) in self._whole.items():
            part = getattr(self, name).detach()
            out[name] = part.clone() if k == 1 else self.group.comm.all_gather_into(part.new_empty(shape), part)
        return out

    def extra_repr(self) -> str:
        k, j = self.workers_per_group, self.group.index
        return f"{self.spec.describe()}, partition_dim=1, slice {j} of {k} ({self.spec.out_size // k} outputs)"


class OnOneWorker(PartitionedLayer):
    """partition_dim -1: the whole layer on the group's worker 0, which computes it for the
    group's batch; the other workers hold no parameters for it."""

    partition_dim = -1

    def __init__(self, layer: nn.Linear | nn.Conv2d, group: WorkerGroup):
        super().__init__(layer, group)
        for name in _PARAMS:
            self.register_parameter(name, getattr(layer, name) if group.is_root else None)

    def forward(self, x: Tensor) -> Tensor:
        gathered = to_root(x, self.group)
        mine = self._output_like(x)
        y = self.spec.apply(gathered, self.weight, self.bias) if self.group.is_root else gathered
        return from_root(y, self.group, tuple(mine.shape), mine.dtype)

    def _output_like(self, x: Tensor) -> Tensor:
        """A meta tensor shaped like this worker's output for input `x` (costs no memory)."""
        meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype, _) in self._whole.items()}
        return self.spec.apply(x.to("meta"), meta["weight"], meta.get("bias"))

    def full_tensors(self) -> dict[str, Tensor]:
        out = {}
        for name, (shape, dtype, device) in self._whole.items():
            t = getattr(self, name).detach().clone() if self.group.is_root else torch.empty(shape, dtype=dtype,
                                                                                             device=device)
            if self.workers_per_group > 1:
                self.group.comm.broadcast(t, src=self.group.peer(0))
            out[name] = t
        return out

    def extra_repr(self) -> str:
        where = "here" if self.group.is_root else f"on rank {self.group.root}"
        return f"{self.spec.describe()}, partition_dim=-1, on worker 0 ({where})"
