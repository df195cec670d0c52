"""The reduce-scatter hook: each bucket reduce-scattered onto the ranks that own its parameters' slices.

With servers co-located with the workers of a group (SINGA's AllReduce framework), server
j needs the group's summed gradient only for the slices it owns. As backward fills each
bucket, its elements are laid out by owner (the chunk of server j: the bucket's elements
in j's slices, then the bucket's used/active flags, padded to one length) and
reduce-scattered: each worker receives the sum of its own chunk only. With the
all-gather of the updated slices that follows the step, a worker sends 2(n-1)/n of the
parameters per step, where an all-reduce of the gradients and the all-gather send 3(n-1)/n.

The AllReduce cluster framework (`troupe.cluster`'s co-located servers) uses it with its slices;
this module needs of a slice only the four numbers of `OwnedRange`, so it imports nothing from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from troupe.runtime.comm import Communicator, Handle
from troupe.sync.bucket import Bucket


class OwnedRange(Protocol):
    """Elements [start, stop) of the flattened parameter number `param`, owned by rank `server` of the
    communicator (`troupe.cluster`'s slices are such ranges)."""

    @property
    def param(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...
    @property
    def server(self) -> int: ...


class BucketScatter:
    """A reduce hook for `GradReducer`: after its handle completes, ``bucket.data`` holds the group's
    mean gradient at the elements of this rank's slices (elsewhere: this rank's own), and
    ``bucket.flags`` the summed flags, as after an all-reduce."""

    def __init__(self, comm: Communicator, buckets: Sequence[Bucket], params: Sequence[Tensor],
                 slices: Sequence[OwnedRange]):
        self.comm = comm
        self.n, self.me = comm.world_size, comm.rank
        self.prescale = 1.0 / self.n
        index = {id(p): i for i, p in enumerate(params)}
        self.layout: dict[int, tuple[list[Tensor], int]] = {}
        for b in buckets:
            owned: list[list[int]] = [[] for _ in range(self.n)]
            for k, p in enumerate(b.params):
                for s in slices:
                    if s.param == index[id(p)]:
                        owned[s.server].extend(range(b.offsets[k] + s.start, b.offsets[k] + s.stop))
            positions = [torch.tensor(o, dtype=torch.long) for o in owned]
            self.layout[b.index] = (positions, max(len(o) for o in owned) + b.flags.numel())

    mean_over_active = True
    carries_digest = False
    coalesce = False

    def __call__(self, bucket: Bucket) -> Handle:
        positions, length = self.layout[bucket.index]
        nflags = bucket.flags.numel()
        chunks = bucket.data.new_zeros(self.n, length)
        for j, pos in enumerate(positions):
            torch.index_select(bucket.data, 0, pos, out=chunks[j, : pos.numel()])
        chunks[:, length - nflags :] = bucket.flags
        mine = bucket.data.new_empty(length)
        inner = self.comm.reduce_scatter(mine, chunks.reshape(-1), async_op=True)

        def then() -> None:
            inner.wait()
            pos = positions[self.me]
            bucket.data.index_copy_(0, pos, mine[: pos.numel()])
            bucket.flags.copy_(mine[length - nflags :])

        return Handle(None, then, label=bucket.label)
