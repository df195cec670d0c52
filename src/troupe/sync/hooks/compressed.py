"""The compression hook: each bucket's gradients through a Compressor, bucket by bucket while backward runs.

`CompressedReduce` turns a `troupe.compress.Compressor` (fp16/bf16, top-K, threshold, with or
without error feedback) into a reduce hook, so compression overlaps backward like the plain
all-reduce. `troupe.strategies.allreduce.AllReduce` uses it when it is given a compressor;
which compressor a dist_option means is `troupe.strategies.registry`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from troupe.compress import Compressor
from troupe.runtime.comm import Communicator, Handle
from troupe.sync.bucket import Bucket


@dataclass(frozen=True)
class CompressedReduce:
    """A reduce hook that sends each bucket's gradients through `compressor`.

    Parameters below `min_compress_size` elements travel dense, in one fp32 all-reduce
    with the bucket's flags. The rest is compressed as one vector named
    ``bucket<index>``; summable payloads are all-reduced, the others all-gathered and
    summed after decompression. Without small parameters the flags ride with the payload
    (gathered and summed here, or summed inside a half-precision payload, which holds
    small integers exactly: fp16 up to 2048 ranks, bf16 up to 256), so each bucket costs
    one collective. Either way the bucket ends up holding the mean and the exact sum of
    the flags, as the reducer expects.
    """

    comm: Communicator
    compressor: Compressor
    min_compress_size: int = 0
    prescale: None = None
    mean_over_active: bool = True
    carries_digest: bool = False  # a half-precision payload cannot carry the digest exactly
    coalesce: bool = False  # compresses bucket by bucket

    def __call__(self, bucket: Bucket) -> Handle:
        comm, compressor, n = self.comm, self.compressor, self.comm.world_size
        big = [k for k in range(len(bucket.params)) if bucket.numels[k] >= self.min_compress_size]
        small = [k for k in range(len(bucket.params)) if bucket.numels[k] < self.min_compress_size]
        if not big:
            return _dense_part(comm, bucket, small)
        # The flags go with the small parameters when there are some, else with the payload.
        dense = _dense_part(comm, bucket, small) if small else None
        vec = bucket.data if not small else torch.cat([bucket.view(k).reshape(-1) for k in big])
        payload, ctx = compressor.compress(vec, f"bucket{bucket.index}")
        if compressor.summable:
            if dense is None and _carries_flags(payload, n):
                return _summed_with_flags(comm, compressor, bucket, payload, ctx)
            dense = dense or _dense_part(comm, bucket, [])
            sent = [comm.all_reduce(t, "sum", async_op=True) for t in payload]
        else:
            # Every rank's flags are gathered with its payload and summed here.
            gathered = comm.all_gather_packed(
                payload + ([] if dense else [bucket.flags]), same_sizes=compressor.fixed_size
            )

        def finish() -> None:
            if dense is not None:
                dense.wait()
            if compressor.summable:
                for h in sent:
                    h.wait()
                total = compressor.decompress(payload, ctx)
            else:
                parts = gathered.result()
                if dense is None:
                    bucket.flags.copy_(sum(p[-1] for p in parts))
                    parts = [p[:-1] for p in parts]
                total = sum(compressor.decompress(p, ctx) for p in parts)
            _write_mean(bucket, big, total.reshape(-1), n)

        return Handle(None, finish)


def _carries_flags(payload: list[Tensor], world_size: int) -> bool:
    """Is the payload one floating tensor whose dtype sums the flags (at most world_size) exactly?"""
    if len(payload) != 1 or not payload[0].is_floating_point():
        return False
    return world_size <= 2 / torch.finfo(payload[0].dtype).eps  # integers up to 2**(mantissa bits + 1) are exact


def _dense_part(comm: Communicator, bucket: Bucket, small: list[int]) -> Handle:
    """Start summing the small parameters' gradients and the flags in fp32; the handle writes the mean back."""
    n = comm.world_size
    dense = torch.cat([bucket.view(k).reshape(-1) for k in small] + [bucket.flags])
    inner = comm.all_reduce(dense, "sum", async_op=True)

    def finish() -> None:
        inner.wait()
        offset = 0
        for k in small:
            view = bucket.view(k)
            view.copy_(dense[offset : offset + view.numel()].view_as(view)).div_(n)
            offset += view.numel()
        bucket.flags.copy_(dense[offset:])

    return Handle(None, finish)


def _summed_with_flags(
    comm: Communicator, compressor: Compressor, bucket: Bucket, payload: list[Tensor], ctx: Any
) -> Handle:
    """One all-reduce of the payload with the flags appended (as the payload's dtype)."""
    nflags = bucket.flags.numel()
    carrier = torch.cat([payload[0], bucket.flags.to(payload[0].dtype)])
    inner = comm.all_reduce(carrier, "sum", async_op=True)

    def finish() -> None:
        inner.wait()
        bucket.flags.copy_(carrier[-nflags:])
        total = compressor.decompress([carrier[:-nflags]], ctx)
        _write_mean(bucket, list(range(len(bucket.params))), total.reshape(-1), comm.world_size)

    return Handle(None, finish)


def _write_mean(bucket: Bucket, members: list[int], total: Tensor, n: int) -> None:
    """Write ``total / n`` (the listed parameters back to back) into the bucket."""
    total = total.div_(n)
    if len(members) == len(bucket.params):
        bucket.data.copy_(total)
        return
    offset = 0
    for k in members:
        view = bucket.view(k)
        view.copy_(total[offset : offset + view.numel()].view_as(view))
        offset += view.numel()
