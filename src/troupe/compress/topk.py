"""Top-K sparsification: the ceil(spars * n) elements of largest magnitude."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor


def check_fraction(spars: float) -> float:
    """`spars` as a float in (0, 1], or a ValueError naming it."""
    if isinstance(spars, bool) or not isinstance(spars, (int, float)) or not 0 < spars <= 1:
        raise ValueError(f"spars for top-K is the fraction of elements sent and must be in (0, 1], got {spars!r}")
    return float(spars)


def topk_count(spars: float, numel: int) -> int:
    """ceil(spars * numel), at least 1 for a non-empty tensor.

    The product is rounded to 9 decimals first so that 0.07 * 100 (7.000000000000001 in
    binary floating point) counts 7, not 8.
    """
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(round(spars * numel, 9))))


class TopKCompressor:
    """Keeps the ceil(spars * n) largest-magnitude elements as (int32 index, value) pairs.

    Unlike SINGA, whose sort truncates magnitudes to integers, the selection is by
    true magnitude (`torch.topk` on ``|g|``).
    """

    summable: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True

    def __init__(self, spars: float):
        self.spars = check_fraction(spars)

    def compress(self, grad: Tensor, name: str) -> tuple[list[Tensor], Any]:
        flat = grad.reshape(-1)
        if flat.numel() >= 2**31:
            raise ValueError(f"{name} has {flat.numel()} elements; int32 indices address at most 2**31")
        k = topk_count(self.spars, flat.numel())
        index = topk_indices(flat.abs(), k)
        return [index.to(torch.int32), flat[index]], (flat.numel(), grad.shape, grad.dtype)

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        return scatter_dense(payload, ctx)

    def __repr__(self) -> str:
        return f"TopKCompressor(spars={self.spars})"


def topk_indices(magnitude: Tensor, k: int) -> Tensor:
    """Indices of the `k` largest entries of the 1-D `magnitude`, exactly, in no particular order.

    On the CPU `torch.topk` of a large tensor is slow (11 ms for k=4,311 of 431,080
    elements, against 1 ms here). So a threshold is first estimated from a strided sample
    (no random numbers: the user's generator is left alone) to keep about 2k candidates,
    and topk runs on those. Exact whenever at least k candidates pass, since then the
    threshold is at most the k-th largest value; otherwise it falls back to the full topk.
    """
    n = magnitude.numel()
    if magnitude.device.type != "cpu" or n < 2**15 or 16 * k > n:
        return magnitude.topk(k, sorted=False).indices
    sample = magnitude[:: max(1, n // 8192)]
    m = sample.numel()
    above = min(m, max(1, math.ceil(2 * k * m / n)))  # sample entries expected above the threshold
    threshold = sample.kthvalue(m - above + 1).values
    candidates = (magnitude >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return magnitude.topk(k, sorted=False).indices
    return candidates[magnitude[candidates].topk(k, sorted=False).indices]


def scatter_dense(payload: Sequence[Tensor], ctx: Any) -> Tensor:
    """A dense tensor with ``values`` at ``indices`` and zeros elsewhere."""
    index, values = payload
    numel, shape, dtype = ctx
    out = torch.zeros(numel, dtype=dtype, device=values.device)
    out[index.long()] = values
    return out.view(shape)
