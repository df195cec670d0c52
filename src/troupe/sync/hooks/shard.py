"""The sharding hook: each bucket's gradients reduce-scattered, so that rank r keeps the mean of chunk r.

Under sharded data parallelism (`troupe.strategies.sharded`: ``DistOpt(opt, shard=...)``) a
bucket's gradient part is padded to k equal chunks (``Bucket.padded``); rank r owns chunk r
of every bucket, steps the optimizer over it alone and all-gathers it afterwards. So the
reduction needs to leave rank r only the mean of its own chunk: a reduce-scatter, which sends
(n-1)/n of the bucket where an all-reduce sends 2(n-1)/n. The bucket's flags (which ranks had
each gradient, who was active) still reach every rank, summed by a small all-reduce of their own.
That holds on NCCL; Gloo's reduce-scatter sends what an all-reduce does (it is one, over a copy of
the input), so on Gloo the bucket goes round a ring of point-to-point messages instead
(`Communicator.ring_reduce_scatter`, on a group of its own: `ring`), (n-1)/n of it per rank.

Across worker groups (HSDP: ``across`` is the communicator over the ranks at this rank's place in
every group) the reduction above runs inside the group; then each rank all-reduces its own chunk,
with the bucket's flags beside it, with the same chunk of the other groups: 1/k of the gradients
crosses groups, and the flags are summed over the whole job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from troupe.runtime.comm import Communicator, Handle
from troupe.sync.bucket import Bucket


@dataclass(frozen=True)
class ShardReduce:
    """Reduce-scatter a bucket's padded gradients into ``dest(bucket)`` (its ``padded / k`` elements:
    the mean over ranks of this rank's chunk) and all-reduce its flags.

    `dest` may view the bucket's own buffer (sharded optimizer state only: the full gradient stays);
    the chunk is then received into a new tensor and copied there, since the collective reads the
    whole bucket while it runs."""

    comm: Communicator
    dest: Callable[[Bucket], Tensor]
    across: Communicator | None = None
    """Worker groups (HSDP): the ranks at this rank's place in every group; None: one group, the job."""
    ring: Communicator | None = None
    """Gloo: the group's ranks again, in a process group of their own, for the ring reduce-scatter (None:
    all-reduce the bucket in place, the bytes of Gloo's own reduce-scatter)."""
    mean_over_active: bool = True
    carries_digest: bool = False
    coalesce: bool = False

    @property
    def prescale(self) -> float:
        return 1.0 / (self.comm.world_size * (1 if self.across is None else self.across.world_size))

    def __call__(self, bucket: Bucket) -> Handle:
        dest = self.dest(bucket)
        aliased = dest.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
        if self.comm.backend != "nccl":
            if self.ring is not None:
                return self._ring(bucket, dest, aliased)
            return self._all_reduce(bucket, dest, aliased)
        out = dest.new_empty(dest.shape) if aliased else dest
        scatter = self.comm.reduce_scatter(out, bucket.padded_data, async_op=True)
        flags = self.comm.all_reduce(bucket.flags, "sum", async_op=True)

        def then() -> None:
            scatter.wait()
            flags.wait()
            if aliased:
                dest.copy_(out)
            self._across_groups(bucket, dest)

        return Handle(None, then, label=bucket.label)

    def _ring(self, bucket: Bucket, dest: Tensor, aliased: bool) -> Handle:
        """Gloo: the padded gradients round the ring (this rank's chunk of the sum lands in place; under
        "optimizer" that is `dest` itself), the flags in a small all-reduce beside it."""
        ring = self.ring.ring_reduce_scatter(bucket.padded_data, async_op=True)
        flags = self.comm.all_reduce(bucket.flags, "sum", async_op=True)
        chunk, rank = dest.numel(), self.comm.rank

        def then() -> None:
            ring.wait()
            flags.wait()
            if not aliased:
                dest.copy_(bucket.padded_data[rank * chunk : (rank + 1) * chunk])
            self._across_groups(bucket, dest)

        return Handle(None, then, label=bucket.label)

    def _all_reduce(self, bucket: Bucket, dest: Tensor, aliased: bool) -> Handle:
        """Gloo: its reduce-scatter is an all-reduce of a copy of the bucket underneath (the same bytes on
        the wire as this, plus the copy and a second collective for the flags): all-reduce the bucket
        in place, flags and all, and keep this rank's chunk."""
        whole = self.comm.all_reduce(bucket.buffer, "sum", async_op=True)
        chunk = dest.numel()

        def then() -> None:
            whole.wait()
            if not aliased:
                rank = self.comm.rank
                dest.copy_(bucket.padded_data[rank * chunk : (rank + 1) * chunk])
            self._across_groups(bucket, dest)

        return Handle(None, then, label=bucket.label)

    def _across_groups(self, bucket: Bucket, dest: Tensor) -> None:
        """HSDP: the group's sum of this rank's chunk, and the group's flags, summed with the other groups'
        (one all-reduce of both, packed: the chunk is 1/k of the bucket; the flags are a few elements)."""
        if self.across is None:
            return
        flags = bucket.flags
        packed = torch.cat([dest, flags])
        self.across.all_reduce(packed, "sum")
        dest.copy_(packed[: dest.numel()])
        flags.copy_(packed[dest.numel() :])
