"""Reduce hooks: what the GradReducer does with a sealed bucket (DDP's comm-hook shape).

The contract. A hook is a small object with declared fields (the four of `ReduceHook`),
called with a sealed bucket; it starts the bucket's reduction and returns a Handle. When the
handle completes, ``bucket.data`` holds the mean gradient and ``bucket.flags`` the
per-parameter sum of the used flags across ranks (the reducer then hands the gradients back).
A hook talks only through the Communicator it was given; it knows nothing of optimizers,
strategies or clusters, which choose a hook and hand it to the reducer.

One module per family, as torch's ``ddp_comm_hooks``:

* `allreduce`: `MeanAllReduce`, the plain dense mean (the reducer's default);
* `compressed`: `CompressedReduce`, each bucket through a Compressor (fp16/bf16, top-K, threshold);
* `powersgd`: `PowerSGDReduce`, each bucket's matrices as PowerSGD factors in two rounds;
* `scatter`: `BucketScatter`, reduce-scatter onto the owners of parameter slices (the AllReduce
  cluster framework's co-located servers);
* `send`: `SendBuckets`, each bucket handed to a parameter-server client, nothing reduced here.

Hooks may use `troupe.runtime`, `troupe.compress` and `troupe.sync.bucket`, nothing above `sync/`.
"""

from __future__ import annotations

from typing import Protocol

from troupe.runtime.comm import Handle
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
