"""Gradients that live in the buckets (DDP's gradient_as_bucket_view), on a scripted communicator.

`Twins` plays ranks that all hold this rank's batch, so the mean over ranks is this rank's own
gradient and a plain torch loop on the same batch is the exact reference. Each case checks
that the parameters equal the reference's and that ``p.grad`` is a view of its bucket. The
same cases with real ranks (different batches per rank) are in tests/dist/test_bucket_view.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from troupe.compress import ErrorFeedback, HalfCompressor, TopKCompressor
from troupe.runtime.comm import Future, Handle
from troupe.sync.hooks.compressed import CompressedReduce
from troupe.sync.reducer import GradReducer

STEPS = 4


class Twins:
    """A communicator for `world_size` ranks that all hold the same tensors (a sum is n times this rank's)."""

    recorder = watchdog = None

    def __init__(self, world_size: int = 2):
        self.world_size, self.rank = world_size, 0

    def all_reduce(self, t, op, async_op=False):
        assert op in ("sum", "max")  # max: the step's agreement (troupe.sync.agree)
        if op == "sum":
            t.mul_(self.world_size)
        return Handle(None)

    def all_gather_packed(self, tensors, same_sizes=True):
        return Future(None, lambda: [[t.clone() for t in tensors] for _ in range(self.world_size)])


class Net(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.fc1, self.fc2 = nn.Linear(6, 6), nn.Linear(6, 10)
        if tied:
            self.fc2.weight = self.emb.weight

    def forward(self, tokens):
        return self.fc2(torch.tanh(self.fc1(self.emb(tokens).mean(1))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31 * step + 5)
    return torch.randint(0, 10, (8, 3), generator=g), torch.randint(0, 10, (8,), generator=g)


def loss_of(model, step, part=slice(None)):
    x, y = batch(step)
    return F.cross_entropy(model(x[part]), y[part])


def pair(tied: bool = False, bucket_size: int = 64, hook=None, **kw):
    """(reference model + SGD, the same model + SGD reduced by a GradReducer over Twins)."""
    made = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Net(tied)
        made.append((model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)))
    (_, _), (model, opt) = made
    reducer = GradReducer(list(model.parameters()), Twins(), bucket_size, bucket_size,
                          hook_for_step=(lambda: hook) if hook is not None else None, **kw)
    return made[0], (model, opt, reducer)


def in_bucket(grad: torch.Tensor, reducer: GradReducer) -> bool:
    """Does `grad` live inside one bucket's buffer (the same storage, within the buffer's range)?"""
    for b in reducer.buckets:
        start, size = b.buffer.data_ptr(), b.buffer.numel() * b.buffer.element_size()
        if (grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
                and start <= grad.data_ptr() < start + size):
            return True
    return False


def assert_views(model, reducer):
    for n, p in model.named_parameters():
        assert p.grad is not None and in_bucket(p.grad, reducer), f"{n}: p.grad is not a view of its bucket"


def assert_same(ref, model, tol=1e-5):
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, atol=tol, rtol=tol, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_backward_leaves_views_and_zero_grad_repoints_without_allocating(set_to_none):
    (ref, ref_opt), (model, opt, reducer) = pair()
    storages = [b.buffer.untyped_storage().data_ptr() for b in reducer.buckets]
    slots = None
    for step in range(STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad(set_to_none=set_to_none)
        before = [p.grad for p in model.parameters()]
        loss_of(ref, step).backward()
        loss_of(model, step).backward()
        assert_views(model, reducer)
        now = [p.grad.data_ptr() for p in model.parameters()]
        assert slots is None or now == slots, "p.grad moved to new memory"
        slots = now
        if not set_to_none and step > 0:  # backward added into the views themselves: nothing was copied in
            assert all(g is p.grad for g, p in zip(before, model.parameters()))
        for o in (ref_opt, opt):
            o.step()
        assert_same(ref, model)
    assert [b.buffer.untyped_storage().data_ptr() for b in reducer.buckets] == storages
    assert len(reducer.buckets) > 1


def test_no_sync_accumulates_in_the_bucket():
    (ref, ref_opt), (model, opt, reducer) = pair()
    for step in range(STEPS):
        for o in (ref_opt, opt):
            o.zero_grad()
        for micro in range(3):
            part = slice(3 * micro, 3 * micro + 3)
            (loss_of(ref, step, part) / 3).backward()
            if micro < 2:
                with reducer.paused():
                    (loss_of(model, step, part) / 3).backward()
                assert_views(model, reducer)  # the first micro-batch's gradient was moved in
            else:
                (loss_of(model, step, part) / 3).backward()
        assert_views(model, reducer)
        for o in (ref_opt, opt):
            o.step()
        assert_same(ref, model)


def test_grad_scaler_unscale_and_clipping_work_on_the_views():
    (ref, ref_opt), (model, opt, reducer) = pair()
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in range(2)]
    for step in range(STEPS):
        for m, o, s in ((ref, ref_opt, scalers[0]), (model, opt, scalers[1])):
            o.zero_grad()
            s.scale(loss_of(m, step)).backward()
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            if m is model:
                assert_views(model, reducer)  # unscaled and clipped in place
            s.step(o)
            s.update()
        assert_same(ref, model)


def test_tied_and_frozen_parameters():
    (ref, ref_opt), (model, opt, reducer) = pair(tied=True)
    assert len(reducer.params) == 4  # the tied weight is one parameter, one slot
    for step in range(STEPS):
        if step == 2:
            for m in (ref, model):
                m.fc1.requires_grad_(False)
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            loss_of(m, step).backward()
            o.step()
        assert all(in_bucket(p.grad, reducer) for p in model.parameters() if p.requires_grad)
        assert step < 2 or all(p.grad is None for p in model.fc1.parameters())
        assert_same(ref, model)


def test_frozen_from_the_start_has_no_slot():
    torch.manual_seed(0)
    model = Net()
    model.emb.requires_grad_(False)
    reducer = GradReducer(list(model.parameters()), Twins(), 64, 64)
    loss_of(model, 0).backward()
    assert model.emb.weight.grad is None and id(model.emb.weight) not in [id(p) for p in reducer.params]
    assert all(in_bucket(p.grad, reducer) for p in model.parameters() if p.requires_grad)


def test_compression_with_error_feedback_writes_the_mean_into_the_views():
    """Top-K with error feedback: each step's p.grad is what an independent compressor makes of
    the reference's gradient (one bucket, so the vector is the parameters in reverse order)."""
    residuals: dict = {}
    hook = CompressedReduce(Twins(), ErrorFeedback(TopKCompressor(0.3), residuals))
    (ref, ref_opt), (model, opt, reducer) = pair(bucket_size=10**6, hook=hook)
    mirror = ErrorFeedback(TopKCompressor(0.3), {})
    params = list(ref.parameters())[::-1]
    for step in range(STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            loss_of(m, step).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        payload, ctx = mirror.compress(flat, "bucket0")
        mean, offset = mirror.decompress(payload, ctx), 0
        for p in params:
            p.grad.copy_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        assert_views(model, reducer)
        for o in (ref_opt, opt):
            o.step()
        assert_same(ref, model)
    assert residuals and all(r.abs().sum() > 0 for r in residuals.values())


def test_half_precision_reads_the_bucket_and_writes_back_in_place():
    hook = CompressedReduce(Twins(), HalfCompressor(torch.float16))
    (ref, ref_opt), (model, opt, reducer) = pair(hook=hook)
    for step in range(STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            loss_of(m, step).backward()
        for p in ref.parameters():
            p.grad.copy_(p.grad.half().float())  # what the fp16 wire leaves of a mean of equal gradients
        assert_views(model, reducer)
        for o in (ref_opt, opt):
            o.step()
        assert_same(ref, model)


def test_a_strategy_that_keeps_gradients_local_keeps_them_in_the_bucket():
    """partialUpdate's hook is None: backward stays local, and still lands in the bucket."""
    (ref, ref_opt), (model, opt, reducer) = pair()
    reducer.hook_for_step = lambda: None
    for step in range(STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            loss_of(m, step).backward()
        assert_views(model, reducer)
        for o in (ref_opt, opt):
            o.step()
        assert_same(ref, model)


@pytest.mark.filterwarnings(r"ignore:Using backward\(\) with create_graph=True")
def test_create_graph_gradients_are_not_moved_under_no_sync():
    torch.manual_seed(0)
    model = Net()
    reducer = GradReducer(list(model.parameters()), Twins(), 64, 64)
    with reducer.paused():
        loss_of(model, 0).backward(create_graph=True)
    assert all(p.grad.requires_grad and not in_bucket(p.grad, reducer) for p in model.parameters())
