"""Bucketed gradient reduction that a compiler can put inside the backward graph.

The eager `GradReducer` listens to autograd with Python hooks and launches collectives
through the Communicator: a compiler cannot see either. Here every bucket of the same
fixed layout (`plan_buckets`) gets a `BucketGate`, an identity in the forward over the
bucket's parameters; its backward runs when autograd has produced every gradient of the
bucket (the moment the eager reducer would launch it) and sums them across ranks with
the functional collectives (``torch.ops._c10d_functional.all_reduce`` and
``wait_tensor``), which trace into the graph as ordinary ops. Compiled autograd then
records the whole backward, collectives included, in one graph (SINGA: "we simply
inject the AllReduce op into the computation graph").

`InGraphReduce` carries what every rank must do the same way: the group, the world
size and the step's codec (plain fp32 mean, or fp16/bf16 with SINGA's optional clip,
divided by the world size before the cast so the sum cannot overflow). Knows nothing
of optimizers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from troupe.compress.fp16 import half_dtype

CODECS = ("plain", "fp16", "bf16")
"""What travels inside the graph: the fp32 mean, or half precision (SINGA's backward_and_update_half)."""


@dataclass
class Codec:
    """How one step's buckets travel; read by the gates' backward when it runs (after the update
    call named the dist_option), so a compiled backward is specialised per codec."""

    name: str = "plain"
    clip_value: float | None = None
    """Half precision: clip every gradient element to [-clip_value, clip_value] first (SINGA's clipping)."""

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"graph mode reduces with one of {CODECS}, got {self.name!r}")
        if self.clip_value is not None and not (isinstance(self.clip_value, (int, float)) and self.clip_value > 0):
            raise ValueError(f"clip_value must be a positive number or None, got {self.clip_value!r}")


class InGraphReduce:
    """Sums one bucket's gradients across the ranks of `group_name` with functional collectives."""

    def __init__(self, group_name: str, world_size: int, codec: Codec):
        self.group_name, self.world_size, self.codec = group_name, world_size, codec

    def __call__(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """The mean over ranks of each gradient (the same ops, in the same order, on every rank)."""
        from torch.distributed import _functional_collectives as funcol

        n, codec = self.world_size, self.codec
        flat = torch.cat([g.reshape(-1) for g in grads])
        if codec.name == "plain":
            # As the eager MeanAllReduce: each rank divides first, then the sum is the mean.
            flat = funcol.wait_tensor(funcol.all_reduce(flat * (1.0 / n), "sum", self.group_name))
        else:
            # As the eager fp16 hook: clip, divide by n, cast (the sum cannot overflow), sum, cast back.
            if codec.clip_value is not None:
                flat = flat.clamp(-codec.clip_value, codec.clip_value)
            half = (flat * (1.0 / n)).to(half_dtype(codec.name))
            summed = funcol.wait_tensor(funcol.all_reduce(half, "sum", self.group_name))
            flat = summed.to(flat.dtype) / (1.0 / n) / n
        out, offset = [], 0
        for g in grads:
            out.append(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return out


class BucketGate(torch.autograd.Function):
    """Identity over a bucket's parameters in the forward; their mean over ranks in the backward."""

    @staticmethod
    def forward(ctx, reduce: InGraphReduce, *params: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.reduce = reduce
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[None | Tensor, ...]:  # type: ignore[override]
        # A parameter that took no part in this forward counts as a zero gradient (every rank
        # must send the same bucket).
        full = [g if g is not None else torch.zeros(s, dtype=d, device=v) for g, (s, d, v) in zip(grads, ctx.shapes)]
        return (None, *ctx.reduce(full))


def gate(buckets: Sequence[Sequence[Tensor]], reduce: InGraphReduce) -> dict[int, Tensor]:
    """Pass every bucket's parameters through a gate: ``id(param) -> the tensor the forward should use``."""
    out: dict[int, Tensor] = {}
    for params in buckets:
        for p, t in zip(params, BucketGate.apply(reduce, *params)):
            out[id(p)] = t
    return out
