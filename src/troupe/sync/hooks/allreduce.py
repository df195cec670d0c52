"""The plain hook: the whole bucket, gradients and flags, summed by one all-reduce."""

from __future__ import annotations

from dataclasses import dataclass

from troupe.runtime.comm import Communicator, Handle
from troupe.sync.bucket import Bucket


@dataclass(frozen=True)
class MeanAllReduce:
    """The plain strategy: gradients enter the bucket already divided by the world size (saving
    a pass over the data), then the whole buffer, gradients and flags, is summed in one call."""

    comm: Communicator
    mean_over_active: bool = True
    carries_digest: bool = True
    coalesce: bool = True

    @property
    def prescale(self) -> float:
        return 1.0 / self.comm.world_size

    def __call__(self, bucket: Bucket) -> Handle:
        return self.comm.all_reduce(bucket.buffer, "sum", async_op=True)
