"""Error feedback: what a biased compressor drops this step is added back next step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from troupe.compress.base import Compressor


class ErrorFeedback:
    """Wraps any compressor; keeps, per name, the residual ``(grad + old residual) - sent``.

    Invariant after each `compress`: ``sent + residual == grad + old residual``, where
    ``sent = inner.decompress(payload, ctx)`` is what this rank contributes.

    >>> ef = ErrorFeedback(TopKCompressor(0.01))
    >>> payload, ctx = ef.compress(grad, "bucket0")    # residual of bucket0 updated
    """

    def __init__(self, inner: Compressor, residuals: dict[str, Tensor] | None = None):
        self.inner = inner
        self.residuals: dict[str, Tensor] = {} if residuals is None else residuals
        """Shared with the caller when given, so residuals outlive a wrapper built per step."""

    @property
    def summable(self) -> bool:
        return self.inner.summable

    @property
    def fixed_size(self) -> bool:
        return self.inner.fixed_size

    def compress(self, grad: Tensor, name: str) -> tuple[list[Tensor], Any]:
        old = self.residuals.get(name)
        if old is not None and old.shape != grad.shape:
            raise ValueError(
                f"residual of {name} has shape {tuple(old.shape)} but the gradient has {tuple(grad.shape)}; "
                "was it loaded from a run with another model or bucket size?"
            )
        corrected = grad + old if old is not None else grad
        payload, ctx = self.inner.compress(corrected, name)
        sent = self.inner.decompress(payload, ctx)
        self.residuals[name] = corrected - sent
        return payload, ctx

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        return self.inner.decompress(payload, ctx)

    def residual_norm(self) -> float:
        """The 2-norm of all residuals together."""
        return residual_norm(self.residuals)

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"


def residual_norm(residuals: dict[str, Tensor]) -> float:
    """The 2-norm of all the residuals together (0.0 when there are none)."""
    if not residuals:
        return 0.0
    return float(torch.stack([torch.linalg.vector_norm(r) for r in residuals.values()]).norm())
