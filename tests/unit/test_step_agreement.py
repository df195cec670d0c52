"""How a step chosen per call (SINGA's ``update(loss, option)``) agrees, on a recording communicator.

The first such step exchanges its agreement (one small "max" all-reduce); once the ranks agreed
on a hook that carries the digest, the next per-call step sends nothing extra: bucket 0 goes alone,
the digest in its flags, and its verdict comes before any other collective. A rank whose per-call
step has other collectives sends bucket 0's shape empty first. Real ranks that disagree are in
tests/dist/test_native_loop.py (a StepMismatchError on every rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from troupe.runtime.comm import Handle
from troupe.sync.agree import StepMismatchError, flag_digest
from troupe.sync.hooks.allreduce import MeanAllReduce
from troupe.sync.reducer import GradReducer


class Recorder:
    """Two ranks that hold the same tensors; every collective is logged as (op, elements, dtype)."""

    recorder = watchdog = None

    def __init__(self, world_size: int = 2):
        self.world_size, self.rank, self.epoch = world_size, 0, 0
        self.log: list[tuple[str, int, torch.dtype]] = []
        self.other_digest: tuple[int, int] | None = None
        """Set: the other rank's digest differs (it wrote these into the slots of the sum)."""

    def all_reduce(self, t, op, async_op=False):
        self.log.append((op, t.numel(), t.dtype))
        if op == "sum":
            t.mul_(self.world_size)
            if self.other_digest is not None:
                t[-2:] += torch.tensor(self.other_digest, dtype=t.dtype) - t[-2:] / self.world_size
        return Handle(None)

    def all_gather_object(self, obj):
        return [obj, "another step"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 6), nn.Linear(6, 10)  # 52 + 70 elements: two buckets of 64


def make(comm):
    torch.manual_seed(0)
    model = Net()
    kinds = {"plain": MeanAllReduce(comm), "other": NotCarrying(comm)}
    reducer = GradReducer(list(model.parameters()), comm, 64, 64, describe_step=lambda: current[0])
    current = ["plain"]

    def step(kind: str, steady: bool = True) -> list[tuple[str, int, torch.dtype]]:
        current[0] = kind
        start = len(comm.log)
        reducer.open_step(kinds[kind], per_call=True, steady=steady)
        x = torch.randn(4, 6)
        F.cross_entropy(model.fc2(torch.tanh(model.fc1(x))), torch.arange(4)).backward()
        for p in model.parameters():
            p.grad = None
        return comm.log[start:]

    return reducer, step


class NotCarrying:
    """A hook whose collectives have another shape (as a compressed payload): the plain sum, but it
    does not carry the digest, so it needs an agreement of its own."""

    prescale, coalesce, carries_digest, mean_over_active = None, True, False, True

    def __init__(self, comm):
        self.comm = comm

    def __call__(self, bucket):
        return self.comm.all_reduce(bucket.buffer, "sum", async_op=True)


def test_per_call_steps_exchange_once_then_ride_in_bucket_zero():
    comm = Recorder()
    reducer, step = make(comm)
    sizes = [b.buffer.numel() for b in reducer.buckets]
    assert len(sizes) == 2
    # first per-call step: the exchange (3 int32, max), then the buckets
    first = step("plain")
    assert first[0] == ("max", 3, torch.int32) and all(op == "sum" for op, _, _ in first[1:])
    # the next ones: no exchange; bucket 0 alone (its exact size), then bucket 1
    for _ in range(2):
        assert step("plain") == [("sum", sizes[0], torch.float32), ("sum", sizes[1], torch.float32)]


def test_a_rank_that_changes_kind_sends_bucket_zero_empty_first_then_exchanges_again():
    comm = Recorder()
    reducer, step = make(comm)
    step("plain")
    size0 = reducer.buckets[0].buffer.numel()
    changed = step("other")
    # bucket 0's shape first (the others may be sending bucket 0 itself), then this hook's collectives
    assert changed[0] == ("sum", size0, torch.float32)
    assert [op for op, _, _ in changed] == ["sum"] * len(changed) and len(changed) >= 2
    # a kind without the digest was agreed on: the next per-call step exchanges again
    assert step("plain")[0] == ("max", 3, torch.int32)
    assert step("plain")[0] == ("sum", size0, torch.float32)


def test_local_step_sends_bucket_zero_shape_only_where_the_others_may_send_it():
    comm = Recorder()
    reducer, step = make(comm)
    reducer.local_step()  # nothing agreed yet: nothing to send
    assert comm.log == []
    step("plain")
    start = len(comm.log)
    reducer.local_step()
    assert comm.log[start:] == [("sum", reducer.buckets[0].buffer.numel(), torch.float32)]
    assert step("plain")[0] == ("max", 3, torch.int32)  # after a local step: exchange again


def test_a_digest_that_differs_in_bucket_zero_raises_before_bucket_one_leaves():
    comm = Recorder()
    reducer, step = make(comm)
    step("plain")
    comm.other_digest = flag_digest("fp16, trainable 1111", 2)
    start = len(comm.log)
    with pytest.raises(StepMismatchError, match="another step"):
        step("plain")
    assert comm.log[start:] == [("sum", reducer.buckets[0].buffer.numel(), torch.float32)]
    assert not reducer.in_step
    comm.other_digest = None
    assert step("plain")[0] == ("max", 3, torch.int32)  # after a mismatch: exchange again


def test_a_new_epoch_of_the_group_exchanges_again():
    comm = Recorder()
    _, step = make(comm)
    step("plain")
    comm.epoch += 1  # an elastic job's new quorum: a joiner knows nothing of the last agreement
    assert step("plain")[0] == ("max", 3, torch.int32)


def test_bucket_zero_goes_alone_even_when_every_bucket_is_ready_at_once():
    comm = Recorder()
    reducer, step = make(comm)
    step("plain")
    sizes = [b.buffer.numel() for b in reducer.buckets]
    reducer.open_step(MeanAllReduce(comm), per_call=True)
    for p in reducer.params:  # gradients written by hand: reduce_now finds every bucket ready
        p.grad = torch.ones_like(p)
    start = len(comm.log)
    reducer.reduce_now()
    assert comm.log[start:] == [("sum", sizes[0], torch.float32), ("sum", sizes[1], torch.float32)]
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in reducer.params)  # the mean of equal ranks
    # the PyTorch loop's step (kind fixed) still sends ready buckets as one collective
    for p in reducer.params:
        p.grad = torch.ones_like(p)
    start = len(comm.log)
    reducer.reduce_now()
    assert comm.log[start:] == [("sum", sum(sizes), torch.float32)]


def test_a_warm_up_step_of_a_compressed_option_does_not_promise_its_shape_to_the_next():
    comm = Recorder()
    reducer, step = make(comm)
    size0 = reducer.buckets[0].buffer.numel()
    step("plain", steady=False)  # e.g. top-K's warm-up: plain-shaped now, compressed from some step on
    assert step("plain")[0] == ("max", 3, torch.int32)  # so the next step exchanges again
    assert step("plain", steady=False)[0] == ("sum", size0, torch.float32)  # rides in bucket 0 ...
    assert step("other")[0] == ("max", 3, torch.int32)  # ... but promises nothing: no empty bucket 0 first
