"""Top-K updates to separate servers (`ClusterConfig.wire_topk`): the worker's codec and the payload.

A worker compresses each slice's update with `WireTopK` inside `troupe.compress.ErrorFeedback`
(what it leaves out of a slice is added to its next update of that slice). One Sparse Update
carries one uint8 payload: k int32 indices, then k values in the wire's dtype. The server
checks it (`decode`: size, indices in range and distinct) and scatters it into a dense slice
(`densify`), which it then applies as it applies any Update.

>>> codec = ErrorFeedback(WireTopK(0.01), residuals)
>>> (index, values), _ = codec.compress(update, "slice3")
>>> payload = encode(index, values)                       # payload_bytes(k, values.dtype) bytes
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from troupe.cluster.wire.messages import MessageError
from troupe.compress.topk import TopKCompressor, scatter_dense

INDEX_DTYPE = torch.int32

__all__ = ["WireTopK", "decode", "densify", "encode", "payload_bytes"]


class WireTopK:
    """`TopKCompressor` whose values travel in `dtype` (None: the update's own).

    `decompress` gives back what the server will apply, rounding included, so error
    feedback keeps what the rounding lost as well as the elements left out.
    """

    summable: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True

    def __init__(self, fraction: float, dtype: torch.dtype | None = None):
        self.topk = TopKCompressor(fraction)
        self.dtype = dtype

    def compress(self, grad: Tensor, name: str) -> tuple[list[Tensor], Any]:
        (index, values), ctx = self.topk.compress(grad, name)
        return [index, values if self.dtype is None else values.to(self.dtype)], ctx

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        index, values = payload
        return scatter_dense([index, values.to(ctx[2])], ctx)

    def __repr__(self) -> str:
        return f"WireTopK({self.topk.spars}, {self.dtype})"


def payload_bytes(k: int, dtype: torch.dtype) -> int:
    """The size of a payload of `k` pairs with values in `dtype`."""
    return k * (INDEX_DTYPE.itemsize + dtype.itemsize)


def encode(index: Tensor, values: Tensor) -> Tensor:
    """k (index, value) pairs as one uint8 tensor: the k int32 indices, then the k values."""
    if index.numel() != values.numel():
        raise ValueError(f"{index.numel()} indices but {values.numel()} values")
    return torch.cat([index.to(INDEX_DTYPE).contiguous().view(torch.uint8), values.contiguous().view(torch.uint8)])


def decode(raw: Tensor, k: int, dtype: torch.dtype, numel: int) -> tuple[Tensor, Tensor]:
    """(indices, values) of a received payload of `k` pairs for a slice of `numel` elements;
    `MessageError` unless its size fits and its indices are distinct and in [0, numel)."""
    if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != payload_bytes(k, dtype):
        raise MessageError(f"a payload of {k} pairs with {dtype} values has {payload_bytes(k, dtype)} bytes, "
                           f"got {raw.numel()} {raw.dtype}")
    split = k * INDEX_DTYPE.itemsize
    index, values = raw[:split].view(INDEX_DTYPE), raw[split:].view(dtype)
    if k and (int(index.min()) < 0 or int(index.max()) >= numel):
        raise MessageError(f"index out of range: [{int(index.min())}, {int(index.max())}] for a slice of {numel} "
                           "elements")
    if torch.unique(index).numel() != k:
        raise MessageError(f"{k - torch.unique(index).numel()} repeated index(es) among {k} pairs")
    return index, values


def densify(index: Tensor, values: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """A slice of `numel` elements in `dtype`: `values` at `index`, zeros elsewhere."""
    return scatter_dense([index, values.to(dtype)], (numel, (numel,), dtype))
