"""Reduce hooks: what the GradReducer does with a sealed bucket (DDP's comm-hook shape).

A hook is a small frozen object with declared fields, called with a sealed bucket; it
starts the bucket's reduction and returns a Handle. When the handle completes,
``bucket.data`` holds the mean gradient and ``bucket.flags`` the per-parameter sum of the
used flags across ranks (the reducer then hands the gradients back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from troupe.runtime.comm import Communicator, Handle
from troupe.sync.bucket import Bucket


class ReduceHook(Protocol):
    """Starts the reduction of one sealed bucket."""

    prescale: float | None
    """Gradients enter the bucket multiplied by this (None: as they are)."""
    coalesce: bool
    """May buckets that are ready together go as one `Span` (one collective over their buffers)?"""
    carries_digest: bool
    """Does the bucket's collective have the same shape on every rank whatever the step is, and
    sum the flags exactly? Then the step's agreement rides in the flags (no extra collective)."""
    mean_over_active: bool
    """Rescale to the mean over the ranks still with data (`DistOpt.join`); off for hooks that
    send buckets elsewhere instead of reducing them (the parameter-server client)."""

    def __call__(self, bucket: Bucket) -> Handle: ...


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


@dataclass(frozen=True)
class SendBuckets:
    """Hands each sealed bucket to `send` (a parameter-server client's Update messages); nothing
    comes back into the bucket."""

    send: object
    prescale: None = None
    mean_over_active: bool = False
    carries_digest: bool = False
    coalesce: bool = False

    def __call__(self, bucket: Bucket) -> Handle:
        return self.send(bucket)  # type: ignore[operator]
