"""SINGA's backward_and_update_half: gradients travel as fp16 (or bf16), divided by the world size first.

Each rank divides by the world size before the cast, so the sum cannot overflow; with
``clipping`` every element is first clipped to [-clip_value, clip_value] (SINGA's default 100).
"""

from __future__ import annotations

import torch

from troupe.compress import HalfCompressor
from troupe.compress.fp16 import half_dtype
from troupe.strategies.allreduce import AllReduce, compressed
from troupe.strategies.choice import DistOption
from troupe.strategies.registry import Capabilities, Context, register


@register
class Half(DistOption):
    """fp16 on the wire."""

    name, method = "fp16", "backward_and_update_half"
    supports = Capabilities(graph_mode=True, elastic=True)

    @classmethod
    def build(cls, ctx: Context, clipping: bool = False, clip_value: float = 100, dtype: str = "fp16") -> AllReduce:
        torch_dtype = half_dtype(dtype)
        for p in ctx.params:
            if p.requires_grad and p.dtype != torch.float32:
                raise ValueError(f"half precision needs float32 parameters; {ctx.name_of(p)} is {p.dtype} "
                                 f"(shape {tuple(p.shape)})")
        comm = ctx.comm  # its size is read at each step: an elastic job's group changes size
        compressor = HalfCompressor(torch_dtype, clip_value if clipping else None, scale=lambda: 1.0 / comm.world_size)
        name = "fp16" if torch_dtype == torch.float16 else "bf16"
        return compressed(name, ctx, compressor, f"{name}(clipping={clipping}, clip_value={clip_value})")


@register
class BHalf(Half):
    """bf16 on the wire (fp32's range, 8 bits of mantissa)."""

    name, fixed_args = "bf16", {"dtype": "bf16"}
