"""Detecting NaN/Inf gradients cheaply, and naming the parameters that hold them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

NanPolicy = Literal["raise", "skip", "ignore"]
NAN_POLICIES = ("raise", "skip", "ignore")


def all_finite(flats: Sequence[Tensor]) -> bool:
    """True when every element is finite. One sum per tensor and one sync: NaN and Inf survive a sum.

    A sum can also overflow to Inf from finite values; callers then confirm with `nonfinite`.
    """
    if not flats:
        return True
    return bool(torch.isfinite(torch.stack([t.sum() for t in flats])).all())


def nonfinite(params: Sequence[Tensor]) -> list[Tensor]:
    """The parameters whose gradient holds a NaN or an Inf."""
    return [p for p in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
