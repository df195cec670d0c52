"""The PowerSGD hook: each bucket's matrices as rank-r factors, in two rounds (torch's ``powerSGD_hook``).

Round one sums, in ONE all-reduce, the bucket's uncompressed tensors, its flags and every
compressed matrix's P = M Q (torch sends the uncompressed tensors and P as two collectives, one
after the other). Round two, when the handle is waited on, orthonormalises P, computes
Q = M^T P and averages Q; the bucket then holds P Q^T (and the mean of the rest). The
arithmetic and the state live in `troupe.compress.powersgd`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from troupe.compress.powersgd import LowRankState
from troupe.runtime.comm import Communicator, Handle
from troupe.sync.bucket import Bucket


@dataclass(frozen=True)
class PowerSGDReduce:
    """A reduce hook that sends each bucket's matrices as PowerSGD factors; the rest whole.

    Gradients enter the bucket as they are (no prescale): error feedback works on this rank's
    own gradient, as torch's. A rank that joined (`DistOpt.join`, inactive) sends zeros and
    neither adds nor updates its residual.
    """

    comm: Communicator
    state: LowRankState
    min_compress_size: int = 0
    prescale: None = None
    mean_over_active: bool = True
    carries_digest: bool = False  # a warm-up step's collective has another shape: the agreement goes first
    coalesce: bool = False  # each bucket has its own factors

    def __call__(self, bucket: Bucket) -> Handle:
        comm, state, n = self.comm, self.state, self.comm.world_size
        key = f"powerSGD/bucket{bucket.index}"
        layout = state.layout(key, [tuple(p.shape) for p in bucket.params], self.min_compress_size)
        before = state.feed_back(key, bucket.data) if bucket.active else None
        matrices = [bucket.view(m.slot).view(m.rows, m.cols) for m in layout.compressed]
        dense = [bucket.view(k).reshape(-1) for k in layout.dense]
        nflags, ndense = bucket.flags.numel(), sum(d.numel() for d in dense)
        carrier = bucket.data.new_empty(ndense + nflags + layout.p_size)
        if dense:
            torch.cat(dense, out=carrier[:ndense])
        carrier[ndense : ndense + nflags] = bucket.flags
        p = carrier[ndense + nflags :]
        state.project(key, layout, matrices, p)
        first = comm.all_reduce(carrier, "sum", async_op=True)

        def finish() -> None:
            first.wait()
            offset = 0
            for k, d in zip(layout.dense, dense):
                bucket.view(k).copy_(carrier[offset : offset + d.numel()].view_as(bucket.view(k))).div_(n)
                offset += d.numel()
            bucket.flags.copy_(carrier[ndense : ndense + nflags])
            if layout.compressed:
                q = state.back_project(key, layout, matrices, p)
                comm.all_reduce(q, "sum")
                state.expand(layout, matrices, p, q.div_(n))
            state.keep_residual(key, before, bucket.data)

        return Handle(None, finish, label=bucket.label)
