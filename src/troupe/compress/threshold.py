"""Threshold sparsification: every element with |g| >= spars."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from troupe.compress.topk import scatter_dense


class ThresholdCompressor:
    """Keeps the elements with ``|g| >= spars`` as (int32 index, value) pairs; may keep none."""

    summable: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = False

    def __init__(self, spars: float):
        if isinstance(spars, bool) or not isinstance(spars, (int, float)) or not (spars >= 0 and math.isfinite(spars)):
            raise ValueError(f"spars for threshold sparsification is an absolute threshold >= 0, got {spars!r}")
        self.spars = float(spars)

    def compress(self, grad: Tensor, name: str) -> tuple[list[Tensor], Any]:
        flat = grad.reshape(-1)
        if flat.numel() >= 2**31:
            raise ValueError(f"{name} has {flat.numel()} elements; int32 indices address at most 2**31")
        index = (flat.abs() >= self.spars).nonzero().squeeze(1)
        return [index.to(torch.int32), flat[index]], (flat.numel(), grad.shape, grad.dtype)

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        return scatter_dense(payload, ctx)

    def __repr__(self) -> str:
        return f"ThresholdCompressor(spars={self.spars})"
