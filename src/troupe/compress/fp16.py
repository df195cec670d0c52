"""Half precision: gradients travel as fp16 or bf16 (SINGA's backward_and_update_half)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def half_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"fp16"``/``"bf16"`` (or the torch dtype) as a torch dtype; anything else is a ValueError."""
    if isinstance(dtype, torch.dtype) and dtype in HALF_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in HALF_DTYPES:
        return HALF_DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(HALF_DTYPES)}, got {dtype!r}")


class HalfCompressor:
    """Casts float32 gradients to fp16/bf16, optionally clipped to [-clip_value, clip_value] first.

    Args:
        scale: multiplies the gradient before the cast, and `decompress` divides it
            back out. Reducing over n ranks passes ``1/n``: the ranks' payloads then sum
            to the mean, which cannot overflow where the sum of the gradients would. A
            callable is asked at every call (an elastic job's group changes size between steps).
    """

    summable: ClassVar[bool] = True
    fixed_size: ClassVar[bool] = True

    def __init__(self, dtype: str | torch.dtype = "fp16", clip_value: float | None = None,
                 scale: float | Callable[[], float] = 1.0):
        self.dtype = half_dtype(dtype)
        if clip_value is not None and not (isinstance(clip_value, (int, float)) and clip_value > 0):
            raise ValueError(f"clip_value must be a positive number or None, got {clip_value!r}")
        if not callable(scale) and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive finite number (or a callable giving one), got {scale!r}")
        self.clip_value = clip_value
        self._scale = scale if callable(scale) else float(scale)

    @property
    def scale(self) -> float:
        return float(self._scale()) if callable(self._scale) else self._scale

    def compress(self, grad: Tensor, name: str) -> tuple[list[Tensor], Any]:
        if grad.dtype != torch.float32:
            raise ValueError(f"half precision compresses float32 gradients; {name} is {grad.dtype}")
        g = grad.reshape(-1)
        if self.clip_value is not None:
            g = g.clamp(-self.clip_value, self.clip_value)
        if self.scale != 1.0:
            g = g * self.scale
        return [g.to(self.dtype)], (grad.dtype, grad.shape)

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        dtype, shape = ctx
        out = payload[0].to(dtype)
        if self.scale != 1.0:
            out.div_(self.scale)
        return out.view(shape)

    def __repr__(self) -> str:
        return f"HalfCompressor({self.dtype}, clip_value={self.clip_value}, scale={self.scale})"
