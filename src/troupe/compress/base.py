"""The Compressor protocol, and the identity compressor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from torch import Tensor


class Compressor(Protocol):
    """Turns a gradient into a smaller payload, and a payload (or a sum of payloads) back.

    ``decompress(*compress(g, name))`` is ``g`` up to the codec's loss. A compressor
    keeps no state between calls; error feedback is the `ErrorFeedback` wrapper's job.
    """

    summable: ClassVar[bool]
    """Can payloads from different ranks simply be added (all-reduce), or must they be gathered?"""
    fixed_size: ClassVar[bool]
    """Do the payload lengths depend only on the gradient's size (so ranks need not exchange them)?"""

    def compress(self, grad: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """The payload (1-D tensors to send) and a local context for `decompress`."""
        ...

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """A dense tensor of the original shape and dtype."""
        ...


class NoCompression:
    """Sends the gradient as it is (the plain path, for comparisons)."""

    summable: ClassVar[bool] = True
    fixed_size: ClassVar[bool] = True

    def compress(self, grad: Tensor, name: str) -> tuple[list[Tensor], Any]:
        return [grad.reshape(-1)], grad.shape

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        return payload[0].view(ctx)

    def __repr__(self) -> str:
        return "NoCompression()"
