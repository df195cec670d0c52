"""Gradients that live in the buckets, with real ranks: every case equals one process and keeps
``p.grad`` inside its bucket.

One 2-rank world runs every scenario. Each is written once, as a function of a `Side`
(tests/dist/test_native_loop.py's harness): on a rank it trains with DistOpt on the rank's
share of the batch; as the reference it trains with the torch optimizer, in this process, on
the combined batch. The lossy dist_options' references apply the same codec to each rank's
gradient (one bucket, so the vector is the parameters in reverse order), so every case must
agree within 1e-5. After every step the rank records whether each ``p.grad`` lies inside a
bucket's buffer (or, for a partitioned model's slices, its holder group's flat buffer).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.test_native_loop import B, IN, OUT, MLP, Side, Tied, features, setup, snapshot, tokens
from tests.dist.world import run_world

pytestmark = [pytest.mark.slow]

STEPS = 3
K = 3
"""Micro-batches per step when accumulating."""
TOL = 1e-5
WHOLE = 10**6
"""A bucket size that puts every parameter in one bucket (the codecs' references rely on it)."""


def momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def homes(opt) -> list[torch.Tensor]:
    """The flat buffers a DistOpt's gradients should live in: its buckets and its holder groups' buffers."""
    buffers = [b.buffer for b in opt.reducer.buckets]
    holders = getattr(opt._choice, "holders", None)
    if holders is not None:
        buffers += [flat for flat, _ in filter(None, holders.flats)]
    return buffers


def at_home(grad: torch.Tensor | None, buffers: list[torch.Tensor]) -> bool:
    """Does `grad` share storage with one of `buffers` and lie inside its range?"""
    if grad is None:
        return False
    for buf in buffers:
        start, size = buf.data_ptr(), buf.numel() * buf.element_size()
        if grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() and start <= grad.data_ptr() < start + size:
            return True
    return False


class Record:
    """Where the rank's gradients were after each step (empty list: all in their buckets)."""

    def __init__(self, side: Side):
        self.side, self.strays = side, []

    def check(self, model, opt, step, skip=()):
        if self.side.is_ref:
            return
        buffers = homes(opt)
        self.strays += [f"step {step}: {n}" for n, p in model.named_parameters()
                        if p.requires_grad and n not in skip and not at_home(p.grad, buffers)]

    def result(self, model, **more):
        return {"params": snapshot(model), "strays": self.strays, **more}


def loop(side, model, opt, rec, *, set_to_none=True, data=features, clip=None, steps=STEPS):
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        side.loss(model, step, data).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        rec.check(model, opt, step)
        opt.step()


def sc_plain(side, set_to_none):
    model, opt = setup(side, momentum)
    rec = Record(side)
    loop(side, model, opt, rec, set_to_none=set_to_none)
    return rec.result(model)


def sc_accumulate_clip(side):
    """K micro-batches under no_sync (the last one reduces), then clipping that binds."""
    model, opt = setup(side, momentum)
    rec, norms = Record(side), []
    for step in range(STEPS):
        opt.zero_grad()
        for j in range(K):
            with nullcontext() if j == K - 1 or side.is_ref else opt.no_sync():
                (side.loss(model, step * K + j) / K).backward()
            if j == 0:
                rec.check(model, opt, f"{step} after the first micro-batch")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        rec.check(model, opt, step)
        opt.step()
    return rec.result(model, norms=norms)


def sc_scaler(side):
    model, opt = setup(side, momentum)
    scaler, rec = torch.amp.GradScaler("cpu", init_scale=2.0**10), Record(side)
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(side.loss(model, step)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        rec.check(model, opt, step)
        scaler.step(opt)
        scaler.update()
    return rec.result(model)


def sc_tied(side):
    model, opt = setup(side, momentum, build=Tied)
    rec = Record(side)
    loop(side, model, opt, rec, data=tokens)
    return rec.result(model)


def sc_frozen(side):
    """fc1 frozen before the DistOpt exists (no slot), fc2's bias frozen from step 1."""

    def build():
        m = MLP()
        m.fc1.requires_grad_(False)
        return m

    model, opt = setup(side, momentum, build=build)
    rec, none = Record(side), []
    for step in range(STEPS):
        if step == 1:
            model.fc2.bias.requires_grad_(False)
        opt.zero_grad()
        side.loss(model, step).backward()
        rec.check(model, opt, step)
        none.append([p.grad is None for p in (*model.fc1.parameters(), model.fc2.bias)])
        opt.step()
    return rec.result(model, none=none)


def sc_add_group(side):
    model, opt = setup(side, momentum)
    rec = Record(side)
    for step in range(STEPS + 1):
        if step == 2:
            torch.manual_seed(500 if side.is_ref else 500 + side.rank)
            model.extra = nn.Linear(IN, OUT)
            opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.05})
        opt.zero_grad(set_to_none=False)
        side.loss(model, step).backward()
        rec.check(model, opt, step)
        opt.step()
    return rec.result(model)


def mirror(option: str, world: int):
    """An independent compressor for one rank, built as the dist_option builds its own."""
    from troupe.compress import ErrorFeedback, HalfCompressor, ThresholdCompressor, TopKCompressor

    return {"fp16": lambda: HalfCompressor(torch.float16, None, scale=1.0 / world),
            "bf16": lambda: HalfCompressor(torch.bfloat16, None, scale=1.0 / world),
            "sparseTopK": lambda: ErrorFeedback(TopKCompressor(0.3), {}),
            "sparseThreshold": lambda: ErrorFeedback(ThresholdCompressor(0.02), {})}[option]()


SPARS = {"fp16": {}, "bf16": {}, "sparseTopK": {"spars": 0.3}, "sparseThreshold": {"spars": 0.02}}


def codec_mean(mirrors, vectors):
    """What the compressed hook leaves in a bucket: summable payloads summed then decompressed, the
    others decompressed and summed; divided by the number of ranks."""
    sent = [m.compress(v, "bucket0") for m, v in zip(mirrors, vectors)]
    if mirrors[0].summable:
        total = mirrors[0].decompress([sum(payload[0] for payload, _ in sent)], sent[0][1])
    else:
        total = sum(mirrors[0].decompress(payload, sent[0][1]) for payload, _ in sent)
    return total / len(vectors)


def sc_codec(side, option):
    model, opt = setup(side, momentum, dist_option=option, bucket_size=WHOLE, first_bucket_size=WHOLE, **SPARS[option])
    rec = Record(side)
    mirrors = [mirror(option, side.world) for _ in range(side.world)]
    for step in range(STEPS):
        opt.zero_grad(set_to_none=step % 2 == 0)
        if side.is_ref:
            x, y = features(step, side.world)
            params = list(model.parameters())[::-1]
            vectors = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                F.cross_entropy(model(x[r * B : (r + 1) * B]), y[r * B : (r + 1) * B]), params)])
                for r in range(side.world)]
            mean, offset = codec_mean(mirrors, vectors), 0
            for p in params:
                p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        else:
            side.loss(model, step).backward()
        rec.check(model, opt, step)
        opt.step()
    return rec.result(model)


def sc_partial(side):
    """partialUpdate with one chunk: each rank steps on its own gradient, then the parameters are averaged."""
    import troupe

    if side.is_ref:  # one replica per rank, in this process
        replicas = [setup(side, momentum) for _ in range(side.world)]
        for step in range(STEPS):
            x, y = features(step, side.world)
            for r, (m, o) in enumerate(replicas):
                o.zero_grad()
                F.cross_entropy(m(x[r * B : (r + 1) * B]), y[r * B : (r + 1) * B]).backward()
                o.step()
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m, _ in replicas)):
                    mean = sum(ps) / len(ps)
                    for p in ps:
                        p.copy_(mean)
        return {"params": snapshot(replicas[0][0]), "strays": []}
    model, opt = setup(side, momentum, dist_option="partialUpdate",
                       compression=troupe.CompressionConfig(chunk_size=WHOLE))
    rec = Record(side)
    loop(side, model, opt, rec)
    return rec.result(model)


PLAN = {"fc1": 0, "fc2": 1, "fc3": -1}


def sc_partition(side):
    """A hybrid partitioned MLP (tests/dist/test_partition_train.py's), in-place accumulation."""
    from tests.dist.test_partition import MODELS
    from tests.dist.test_partition_train import B_OWN, data

    make, shape = MODELS["mlp"]
    torch.manual_seed(0)
    if side.is_ref:
        model = make()
        opt = momentum(model.parameters())
    else:
        import troupe

        model = troupe.partition(make(), PLAN, workers_per_group=2)
        opt = troupe.DistOpt(momentum(model.parameters()))
    rows = slice(None) if side.is_ref else slice(side.rank * B_OWN, (side.rank + 1) * B_OWN)
    rec = Record(side)
    for step in range(STEPS):
        x, y = data(side.world, step, shape)
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        rec.check(model, opt, step)
        opt.step()
    if side.is_ref:
        return rec.result(model)
    import troupe

    return {"params": troupe.full_state_dict(model), "strays": rec.strays}


SCENARIOS = {
    "zero_grad_to_none": lambda s: sc_plain(s, True),
    "zero_grad_in_place": lambda s: sc_plain(s, False),
    "no_sync_and_clip": sc_accumulate_clip,
    "grad_scaler": sc_scaler,
    "tied": sc_tied,
    "frozen": sc_frozen,
    "add_param_group": sc_add_group,
    **{option: (lambda s, o=option: sc_codec(s, o)) for option in SPARS},
    "partialUpdate": sc_partial,
    "partition": sc_partition,
}


def world(rank, world_size):
    return {name: fn(Side(world_size, rank)) for name, fn in SCENARIOS.items()}


@pytest.fixture(scope="module")
def two():
    return run_world(world, 2, timeout=120)


@functools.lru_cache(maxsize=None)
def reference(name):
    return SCENARIOS[name](Side(2))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bucket_view_gradients_equal_one_process(two, name):
    ref = reference(name)
    for rank, results in enumerate(two):
        got = results[name]
        assert not got["strays"], f"rank {rank}, {name}: p.grad outside its bucket: {got['strays']}"
        for n, want in ref["params"].items():
            torch.testing.assert_close(got["params"][n], want, atol=TOL, rtol=TOL,
                                       msg=lambda m: f"rank {rank}, {name}, {n}: {m}")
        if name == "frozen":
            assert all(all(step) for step in got["none"][1:]) and got["none"] == ref["none"], got["none"]
        if name == "no_sync_and_clip":
            assert max(ref["norms"]) > 0.05, "the clip must bind for the case to mean anything"
