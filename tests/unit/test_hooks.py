"""The reduce-hook package: its layering, the contract's fields, and each family on a scripted communicator.

The scripted communicator plays `n` ranks that all hold the same bucket: a sum across ranks is
n times this rank's values, so after any hook the bucket must hold this rank's own gradient
(the mean) and n times its flags. The exchanges themselves are tested with real processes in
tests/dist (test_equivalence, test_options, test_cluster).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from troupe.compress import HalfCompressor, NoCompression, TopKCompressor
from troupe.runtime.comm import Future, Handle
from troupe.sync.bucket import Bucket
from troupe.sync.hooks.allreduce import MeanAllReduce
from troupe.sync.hooks.compressed import CompressedReduce
from troupe.sync.hooks.scatter import BucketScatter
from troupe.sync.hooks.send import SendBuckets

from tests.unit.test_import_graph import package_graph


class Twins:
    """A communicator for `world_size` ranks that all hold the same tensors."""

    def __init__(self, world_size: int, rank: int = 0):
        self.world_size, self.rank = world_size, rank

    def all_reduce(self, t, op, async_op=False):
        assert op == "sum"
        t.mul_(self.world_size)
        return Handle(None)

    def reduce_scatter(self, output, input, async_op=False):
        output.copy_(input.view(self.world_size, -1)[self.rank] * self.world_size)
        return Handle(None)

    def all_gather_packed(self, tensors, same_sizes=True):
        return Future(None, lambda: [[t.clone() for t in tensors] for _ in range(self.world_size)])


def sealed_bucket(*shapes: tuple[int, ...]) -> tuple[Bucket, list[torch.Tensor]]:
    """A bucket of parameters of these shapes, every gradient in (integers: exact in fp16), sealed."""
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    bucket = Bucket(0, params)
    grads = [torch.arange(p.numel(), dtype=torch.float32).view_as(p) - 3 for p in params]
    for p, g in zip(params, grads):
        bucket.add_grad(p, g)
    bucket.seal()
    return bucket, grads


def test_sync_imports_nothing_above_it():
    # The gradient path (reducer -> hooks) never climbs back up to the packages choosing the hook.
    above = {"strategies", "cluster", "partition", "troupe", "distopt", "graphstep", "bench", "cli"}
    climbing = {k: v for k, v in package_graph()["sync"].items() if k in above}
    assert not climbing, climbing


@pytest.mark.parametrize("hook", [
    MeanAllReduce(Twins(2)), CompressedReduce(Twins(2), NoCompression()), SendBuckets(print),
    BucketScatter(Twins(2), [], [], []),
])
def test_every_hook_declares_the_contract(hook):
    for field in ("prescale", "coalesce", "carries_digest", "mean_over_active"):
        assert hasattr(hook, field), (type(hook).__name__, field)


@pytest.mark.parametrize("compressor, min_size", [
    (NoCompression(), 0), (HalfCompressor(torch.float16), 0), (HalfCompressor(torch.bfloat16), 5),
    (TopKCompressor(1.0), 0), (TopKCompressor(1.0), 5),
])
def test_compressed_reduce_leaves_the_mean_and_summed_flags(compressor, min_size):
    bucket, grads = sealed_bucket((3, 4), (2,), (5,))
    flags = bucket.flags.clone()
    CompressedReduce(Twins(3), compressor, min_size)(bucket).wait()
    for k, g in enumerate(grads):
        assert torch.equal(bucket.view(k), g), k
    assert torch.equal(bucket.flags, 3 * flags)


def test_mean_all_reduce_sums_the_whole_buffer():
    bucket, grads = sealed_bucket((3, 4), (2,))
    before = bucket.buffer.clone()
    hook = MeanAllReduce(Twins(4))
    assert hook.prescale == 0.25
    hook(bucket).wait()
    assert torch.equal(bucket.buffer, 4 * before)


class Range(NamedTuple):
    """A plain (param, start, stop, server) range: all BucketScatter needs of a cluster's slice."""

    param: int
    start: int
    stop: int
    server: int


@pytest.mark.parametrize("rank", [0, 1])
def test_bucket_scatter_takes_plain_ranges(rank):
    bucket, grads = sealed_bucket((3, 4), (5,))
    params = bucket.params[::-1]  # the parameter numbering need not be the bucket's order
    ranges = [Range(1, 0, 7, 0), Range(1, 7, 12, 1), Range(0, 0, 5, 1)]
    hook = BucketScatter(Twins(2, rank), [bucket], params, ranges)
    positions, length = hook.layout[bucket.index]
    assert [p.tolist() for p in positions] == [list(range(7)), list(range(7, 12)) + list(range(12, 17))]
    assert length == 10 + bucket.flags.numel()
    own = bucket.data.clone()
    flags = bucket.flags.clone()
    hook(bucket).wait()
    mine = positions[rank]
    # Twins: the sum over 2 ranks lands on the owner (the prescale would have halved it first).
    assert torch.equal(bucket.data[mine], 2 * own[mine])
    others = torch.ones(bucket.data.numel(), dtype=torch.bool)
    others[mine] = False
    assert torch.equal(bucket.data[others], own[others])
    assert torch.equal(bucket.flags, 2 * flags)
