"""DistOpt in the PyTorch-native loop (backward, synchronize, clip, GradScaler, step, scheduler).

Each scenario is written once, as a function of a `Side`: on a rank of a spawned world it
trains with DistOpt on the rank's share of the batch; as the reference (``rank=None``) it
trains with the plain torch optimizer, in this process, on the combined batch (the mean
of the ranks' losses). The two must agree within 1e-5 (the codec's tolerance for the
lossy dist_options), and the ranks must hold bit-identical parameters. Several scenarios
share one world: a world costs seconds.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.world import run_world

IN, HID, OUT, B = 6, 8, 4, 4
"""Layer sizes and the per-rank batch."""
K = 3
"""Micro-batches per optimizer step when accumulating."""
WORLD_TIMEOUT = 90.0


class MLP(nn.Module):
    """Three layers; `extra` (added mid-run by one scenario) joins the output when present."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, HID)
        self.fc3 = nn.Linear(HID, OUT)

    def forward(self, x):
        out = self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        return out + self.extra(x) if hasattr(self, "extra") else out


VOCAB, DIM, SEQ = 10, 6, 3


class Tied(nn.Module):
    """A tiny language model whose output layer is its embedding (one Parameter, used twice)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.hid = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.hid(self.emb(tokens).mean(1))))


def features(step, world):
    g = torch.Generator().manual_seed(7919 * step + 1)
    return torch.randn(world * B, IN, generator=g), torch.randint(0, OUT, (world * B,), generator=g)


def tokens(step, world):
    g = torch.Generator().manual_seed(7919 * step + 2)
    return torch.randint(0, VOCAB, (world * B, SEQ), generator=g), torch.randint(0, VOCAB, (world * B,), generator=g)


@dataclass
class Side:
    """Where a scenario runs: rank `rank` of a world with DistOpt, or (rank None) the reference."""

    world: int
    rank: int | None = None

    @property
    def is_ref(self) -> bool:
        return self.rank is None

    def loss(self, model, step, data=features):
        """This rank's mean loss; the reference's is the mean over every rank's."""
        x, y = data(step, self.world)
        ranks = range(self.world) if self.is_ref else [self.rank]
        return sum(F.cross_entropy(model(x[r * B : (r + 1) * B]), y[r * B : (r + 1) * B]) for r in ranks) / len(ranks)

    def no_sync(self, opt):
        return nullcontext() if self.is_ref else opt.no_sync()

    def synchronize(self, opt):
        if not self.is_ref:
            opt.synchronize()

    @contextmanager
    def poisoned(self, param, value, when=True):
        """Replace `param`'s gradient by `value` in this backward, on the last rank only (and in the reference)."""
        hit = when and (self.is_ref or self.rank == self.world - 1)
        handle = param.register_hook(lambda g: torch.full_like(g, value)) if hit else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()


def setup(side, make_opt, build=MLP, **distopt_kw):
    """Rank 0's initialisation everywhere: the ranks start from different seeds, DistOpt broadcasts."""
    torch.manual_seed(100 if side.is_ref else 100 + side.rank)
    model = build()
    opt = make_opt(model.parameters())
    if side.is_ref:
        return model, opt
    import troupe

    sgd = troupe.DistOpt(opt, **distopt_kw)
    model.to(sgd.device)
    sgd.sync_parameters(model)
    return model, sgd


def inner(side, opt):
    """The wrapped torch optimizer (the reference's optimizer is its own)."""
    return opt if side.is_ref else opt.optimizer


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2)


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def grads(model):
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def bytes_sent(side):
    if side.is_ref:
        return 0
    import troupe

    return troupe.init().comm.bytes_sent()


# --- scenarios (each runs on a rank and as the reference) -----------------------------------

STEPS = 5


def sc_clip(side):
    """(1) clip_grad_norm_ between synchronize and step; p.grad is the mean when backward returns."""
    model, opt = setup(side, sgd_momentum)
    out = {"after_backward": [], "norms": []}
    for step in range(STEPS):
        side.loss(model, step).backward()
        out["after_backward"].append(grads(model))
        side.synchronize(opt)
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    out["params"] = snapshot(model)
    return out


def sc_accumulate(side, armed):
    """(2) K micro-batches per step; `armed`: the last backward reduces, else all under no_sync."""
    model, opt = setup(side, adamw)
    out = {"after_backward": [], "quiet_bytes": 0}
    for step in range(4):
        for j in range(K):
            last = armed and j == K - 1
            before = bytes_sent(side)
            with nullcontext() if last else side.no_sync(opt):
                (side.loss(model, step * K + j) / K).backward()
            if not last:
                out["quiet_bytes"] += bytes_sent(side) - before
        if armed:
            out["after_backward"].append(grads(model))
        side.synchronize(opt)
        opt.step()
        opt.zero_grad()
    out["params"] = snapshot(model)
    return out


INF_STEP = 2


def sc_scaler(side):
    """(3) GradScaler("cpu"); an inf in the last rank's gradient at INF_STEP: every rank skips it."""
    model, opt = setup(side, sgd_momentum)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    out = {"scales": [], "params": []}
    for step in range(STEPS):
        with side.poisoned(model.fc2.bias, math.inf, step == INF_STEP):
            scaler.scale(side.loss(model, step)).backward()
        side.synchronize(opt)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out["scales"].append(scaler.get_scale())
        out["params"].append(snapshot(model))
    return out


def sc_sched(side):
    """(4) StepLR built on the DistOpt; then a state_dict round trip continues exactly."""
    model, opt = setup(side, adamw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    out = {"is_optimizer": isinstance(opt, torch.optim.Optimizer), "lr": [], "inner_lr": []}
    for step in range(STEPS):
        side.loss(model, step).backward()
        side.synchronize(opt)
        opt.step()
        opt.zero_grad()
        sched.step()
        out["lr"].append(opt.param_groups[0]["lr"])
        out["inner_lr"].append(inner(side, opt).param_groups[0]["lr"])
    state, sched_state = copy.deepcopy(opt.state_dict()), sched.state_dict()
    model2, opt2 = setup(side, adamw)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(state)
    out["loaded_lr"] = (opt2.param_groups[0]["lr"], inner(side, opt2).param_groups[0]["lr"])
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    sched2.load_state_dict(sched_state)
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        for step in range(STEPS, STEPS + 2):
            side.loss(m, step).backward()
            side.synchronize(o)
            o.step()
            o.zero_grad()
            s.step()
    out["params"], out["restored"] = snapshot(model), snapshot(model2)
    out["restored_lr"] = (opt2.param_groups[0]["lr"], inner(side, opt2).param_groups[0]["lr"])
    return out


def sc_tied(side):
    """(5) An embedding and the output layer share one Parameter."""
    model, opt = setup(side, sgd_momentum, build=Tied)
    for step in range(STEPS):
        side.loss(model, step, tokens).backward()
        side.synchronize(opt)
        opt.step()
        opt.zero_grad()
    assert model.out.weight is model.emb.weight
    return {"params": snapshot(model), "nparams": sum(len(g["params"]) for g in opt.param_groups)}


FREEZE_AT = 3


def sc_frozen(side):
    """(6) fc1 frozen (requires_grad=False) on every rank from step FREEZE_AT."""
    model, opt = setup(side, sgd_momentum)
    out = {"grad_none": []}
    for step in range(STEPS + 1):
        if step == FREEZE_AT:
            model.fc1.requires_grad_(False)
            out["at_freeze"] = snapshot(model)
        side.loss(model, step).backward()
        side.synchronize(opt)
        if step >= FREEZE_AT:
            out["grad_none"].append(all(p.grad is None for p in model.fc1.parameters()))
        opt.step()
        opt.zero_grad()
    out["params"] = snapshot(model)
    return out


def sc_add_group(side):
    """(7) A layer created mid-run (a different init on each rank) joins through add_param_group."""
    model, opt = setup(side, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    out = {}
    for step in range(STEPS + 1):
        if step == FREEZE_AT:
            torch.manual_seed(500 if side.is_ref else 500 + side.rank)
            model.extra = nn.Linear(IN, OUT)
            opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.05})
            out["extra_init"] = snapshot(model.extra)  # rank 0's values, everywhere
        side.loss(model, step).backward()
        side.synchronize(opt)
        opt.step()
        opt.zero_grad()
    out["params"] = snapshot(model)
    out["groups"] = (len(opt.param_groups), len(inner(side, opt).param_groups))
    return out


SHAPES = {"a": (5,), "b": (3, 2), "c": (4,), "d": (2,)}
"""(9) `c` gets a gradient on rank 0 only, `d` on no rank."""


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        for n, s in SHAPES.items():
            self.register_parameter(n, nn.Parameter(torch.randn(s)))


def hand_grad(rank, step, name):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + list(SHAPES).index(name))
    return torch.randn(SHAPES[name], generator=g)


def sc_direct(side):
    """(9) Gradients written into p.grad without autograd: step() reduces them (or synchronize())."""
    model, opt = setup(side, lambda ps: torch.optim.SGD(ps, lr=1.0), build=Bag)
    out = {"synchronized": [], "history": [snapshot(model)]}
    for step in range(3):
        for name in ("a", "b", "c"):
            ranks = range(side.world) if side.is_ref else [side.rank]
            mine = [hand_grad(r, step, name) for r in ranks if name != "c" or r == 0]
            if mine:
                getattr(model, name).grad = sum(mine) / len(ranks)
        if step == 1:
            side.synchronize(opt)
            out["synchronized"].append(grads(model))
        opt.step()  # step 0 and 2: step() itself reduces
        out["d_grad_none"] = model.d.grad is None
        opt.zero_grad()
        out["history"].append(snapshot(model))
    return out


NAN_STEP = 2


def sc_nan_skip(side):
    """(11) nan_policy="skip": a NaN on the last rank at NAN_STEP skips the step everywhere."""
    model, opt = setup(side, sgd_momentum, nan_policy="skip")
    out = {"history": []}
    for step in range(STEPS):
        with side.poisoned(model.fc1.weight, math.nan, step == NAN_STEP):
            side.loss(model, step).backward()
        if step % 2:
            side.synchronize(opt)  # even steps: step() synchronizes by itself
        if not (side.is_ref and step == NAN_STEP):
            opt.step()
        opt.zero_grad()
        out["history"].append(snapshot(model))
    out["skipped"] = 1 if side.is_ref else opt.skipped_steps
    if not side.is_ref:  # the default policy raises on every rank
        model2, opt2 = setup(side, sgd_momentum)
        with side.poisoned(model2.fc1.weight, math.nan):
            side.loss(model2, 0).backward()
        try:
            opt2.step()
            out["raised"] = None
        except FloatingPointError as e:
            out["raised"] = str(e)
    return out


CODECS = {
    # option: (constructor keywords, rtol, atol as a fraction of the largest |mean|)
    "fp16": ({}, 1e-3, 1e-3),
    "bf16": ({}, 1e-2, 1e-2),
    "sparseTopK": ({"spars": 1.0}, 1e-6, 1e-6),
    "sparseThreshold": ({"spars": 0.0}, 1e-6, 1e-6),
}


def sc_option(side, option):
    """(8) A dist_option through synchronize()/step(): p.grad holds the decompressed mean."""
    kw, _, _ = CODECS[option]
    model, opt = setup(side, lambda ps: torch.optim.SGD(ps, lr=0.1), dist_option=option, **kw)
    out = []
    for step in range(3):
        side.loss(model, step).backward()
        side.synchronize(opt)
        before, g = snapshot(model), grads(model)
        opt.step()
        opt.zero_grad()
        out.append((before, g, snapshot(model)))
    return out


def sc_singa(side):
    """SINGA's methods still work, also mixed with the native loop."""
    model, opt = setup(side, sgd_momentum)
    calls = ["call", "backward_and_update", "update_fp16", "update_plain", "native"]
    history = []
    for step, how in enumerate(calls):
        loss = side.loss(model, step)
        if side.is_ref or how == "native":
            opt.zero_grad()
            loss.backward()
            side.synchronize(opt)
            opt.step()
        elif how == "call":
            opt(loss)
        elif how == "backward_and_update":
            opt.backward_and_update(loss)
        else:
            opt.update(loss, how.split("_")[1])
        history.append(snapshot(model))
    return history


def sc_partial(side):
    """partialUpdate in the native loop == SINGA's backward_and_partial_update, run the same way."""
    import troupe

    config = troupe.CompressionConfig(chunk_size=40)
    histories = {}
    for native in (True, False):
        kw = {"dist_option": "partialUpdate"} if native else {}
        model, opt = setup(side, sgd_momentum, compression=config, **kw)
        histories[native] = []
        for step in range(STEPS):
            loss = side.loss(model, step)
            if native:
                loss.backward()
                opt.synchronize()
                opt.step()
                opt.zero_grad()
            else:
                opt.backward_and_partial_update(loss)
            histories[native].append(snapshot(model))
    return histories


def sc_spec_loop(side):
    """The issue's loop verbatim: AdamW, no_sync accumulation, GradScaler, clipping, StepLR;
    an inf in a micro-batch accumulated under no_sync on the last rank skips that step."""
    model, opt = setup(side, adamw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    out = {"scales": [], "lr": [], "params": []}
    for i in range(K * STEPS):
        last = (i + 1) % K == 0
        with nullcontext() if last else side.no_sync(opt):
            with side.poisoned(model.fc3.bias, math.inf, i == K * INF_STEP + 1):
                scaler.scale(side.loss(model, i) / K).backward()
        if last:
            side.synchronize(opt)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            sched.step()
            out["scales"].append(scaler.get_scale())
            out["lr"].append(opt.param_groups[0]["lr"])
            out["params"].append(snapshot(model))
    return out


def sc_mismatch(side, kind):
    """(10) Rank 0 takes a different dist_option, or freezes a different layer, than the others.

    Runs last in its world: after the error every rank has issued the same collectives, but
    nothing should go on using the DistOpt that raised.
    """
    from troupe.sync.agree import StepMismatchError

    model, opt = setup(side, lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt.update(side.loss(model, 0), "plain")  # one agreed step first
    start = time.monotonic()
    try:
        if kind == "option":
            opt.update(side.loss(model, 1), "fp16" if side.rank == 0 else "plain")
        else:
            (model.fc1 if side.rank == 0 else model.fc2).weight.requires_grad_(False)
            side.loss(model, 1).backward()
            opt.synchronize()
            opt.step()
    except StepMismatchError as e:
        return {"message": str(e), "seconds": time.monotonic() - start, "runtime_error": isinstance(e, RuntimeError)}
    return {"message": None, "seconds": time.monotonic() - start}


SCENARIOS = {
    "clip": sc_clip,
    "accumulate_armed": lambda s: sc_accumulate(s, armed=True),
    "accumulate_unarmed": lambda s: sc_accumulate(s, armed=False),
    "scaler": sc_scaler,
    "sched": sc_sched,
    "tied": sc_tied,
    "frozen": sc_frozen,
    "add_group": sc_add_group,
    "direct": sc_direct,
    "nan_skip": sc_nan_skip,
    "singa": sc_singa,
    "partial": sc_partial,
    "spec_loop": sc_spec_loop,
    **{f"option_{o}": (lambda s, o=o: sc_option(s, o)) for o in CODECS},
    "mismatch_option": lambda s: sc_mismatch(s, "option"),
    "mismatch_frozen": lambda s: sc_mismatch(s, "frozen"),
}


def scenarios_world(rank, world_size, names):
    return {name: SCENARIOS[name](Side(world_size, rank)) for name in names}


@functools.lru_cache(maxsize=None)
def reference(name, world):
    """The single-process run of scenario `name` on the combined batch of `world` ranks (computed once)."""
    return SCENARIOS[name](Side(world))


# --- checks -------------------------------------------------------------------------------


def close(got, want, what, atol=1e-5, rtol=1e-5):
    assert got.keys() == want.keys(), what
    for n in want:
        if want[n] is None or got[n] is None:
            assert got[n] is None and want[n] is None, f"{what} {n}: grad None on one side only"
            continue
        torch.testing.assert_close(got[n], want[n], atol=atol, rtol=rtol, msg=lambda m: f"{what} {n}: {m}")


def identical(results, get, what):
    """Every rank holds bit-identical tensors."""
    first = get(results[0])
    for rank, r in enumerate(results[1:], 1):
        for n, t in get(r).items():
            assert torch.equal(t, first[n]), f"{what} {n}: rank {rank} differs from rank 0"


TWO_RANKS = [name for name in SCENARIOS if name not in ("spec_loop", "mismatch_option")]
"""Every 2-rank scenario runs in one world (its start and first backward cost more than all the steps)."""
THREE_RANKS = ["spec_loop", "option_fp16", "mismatch_option"]


@pytest.fixture(scope="module")
def two():
    return run_world(scenarios_world, 2, TWO_RANKS, timeout=WORLD_TIMEOUT)


@pytest.fixture(scope="module")
def three():
    return run_world(scenarios_world, 3, THREE_RANKS, timeout=WORLD_TIMEOUT)


def test_clip_between_synchronize_and_step(two):
    ref = reference("clip", 2)
    assert max(ref["norms"]) > 0.05, "the clip must bite for this test to mean anything"
    for rank, r in enumerate(two):
        torch.testing.assert_close(torch.tensor(r["clip"]["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6)
        close(r["clip"]["params"], ref["params"], f"rank {rank} clip")
    identical(two, lambda r: r["clip"]["params"], "clip")


def test_backward_returns_the_mean_over_ranks(two):
    ref = reference("clip", 2)
    for rank, r in enumerate(two):
        for step, (got, want) in enumerate(zip(r["clip"]["after_backward"], ref["after_backward"])):
            close(got, want, f"rank {rank} step {step}: p.grad when backward returns")


@pytest.mark.parametrize("armed", [True, False], ids=["last_backward_reduces", "all_under_no_sync"])
def test_accumulation_under_no_sync(two, armed):
    name = "accumulate_armed" if armed else "accumulate_unarmed"
    ref = reference(name, 2)
    for rank, r in enumerate(two):
        assert r[name]["quiet_bytes"] == 0, f"rank {rank}: no_sync backward sent {r[name]['quiet_bytes']} bytes"
        close(r[name]["params"], ref["params"], f"rank {rank} {name}")
        for step, (got, want) in enumerate(zip(r[name]["after_backward"], ref["after_backward"])):
            close(got, want, f"rank {rank} step {step}: accumulated p.grad after the last backward")
    identical(two, lambda r: r[name]["params"], name)


def test_grad_scaler_skips_an_inf_step_on_every_rank(two):
    ref = reference("scaler", 2)
    assert ref["scales"][INF_STEP] == ref["scales"][INF_STEP - 1] / 2
    for rank, r in enumerate(two):
        s = r["scaler"]
        assert s["scales"] == ref["scales"], f"rank {rank}: scales {s['scales']} vs reference {ref['scales']}"
        for n, t in s["params"][INF_STEP].items():
            assert torch.equal(t, s["params"][INF_STEP - 1][n]), f"rank {rank}: step {INF_STEP} was not skipped ({n})"
        for step in range(STEPS):
            close(s["params"][step], ref["params"][step], f"rank {rank} step {step}")
    for step in range(STEPS):
        identical(two, lambda r: r["scaler"]["params"][step], f"scaler step {step}")


def test_step_lr_on_the_distopt_and_state_dict_round_trip(two):
    ref = reference("sched", 2)
    assert len(set(ref["lr"])) > 1
    for rank, r in enumerate(two):
        s = r["sched"]
        assert s["is_optimizer"], "DistOpt must be a torch.optim.Optimizer"
        assert s["lr"] == pytest.approx(ref["lr"]) and s["inner_lr"] == pytest.approx(ref["lr"]), (s["lr"], s["inner_lr"])
        # a scheduler on a DistOpt restored by load_state_dict must still reach the wrapped optimizer
        assert s["loaded_lr"] == pytest.approx(ref["loaded_lr"]), f"rank {rank}: lr after load_state_dict "\
            f"(DistOpt's, wrapped optimizer's) {s['loaded_lr']} vs {ref['loaded_lr']}"
        assert s["restored_lr"] == pytest.approx(ref["restored_lr"]), f"rank {rank}: lr after two more "\
            f"scheduler steps (DistOpt's, wrapped optimizer's) {s['restored_lr']} vs {ref['restored_lr']}"
        close(s["params"], ref["params"], f"rank {rank} sched")
        for n, t in s["restored"].items():
            assert torch.equal(t, s["params"][n]), f"rank {rank}: restored DistOpt diverged at {n}"
    identical(two, lambda r: r["sched"]["params"], "sched")


def test_tied_weights(two):
    ref = reference("tied", 2)
    for rank, r in enumerate(two):
        assert r["tied"]["nparams"] == ref["nparams"] == 3
        close(r["tied"]["params"], ref["params"], f"rank {rank} tied")
    identical(two, lambda r: r["tied"]["params"], "tied")


def test_layer_frozen_mid_run(two):
    ref = reference("frozen", 2)
    for rank, r in enumerate(two):
        f = r["frozen"]
        assert all(f["grad_none"]), f"rank {rank}: a frozen parameter got a gradient: {f['grad_none']}"
        for n in ("fc1.weight", "fc1.bias"):
            assert torch.equal(f["params"][n], f["at_freeze"][n]), f"rank {rank}: frozen {n} moved"
        close(f["params"], ref["params"], f"rank {rank} frozen")
    identical(two, lambda r: r["frozen"]["params"], "frozen")


def test_add_param_group_mid_run(two):
    ref = reference("add_group", 2)
    for rank, r in enumerate(two):
        a = r["add_group"]
        assert a["groups"] == (2, 2), a["groups"]
        close(a["extra_init"], ref["extra_init"], f"rank {rank}: the new group starts from rank 0's values", 0, 0)
        close(a["params"], ref["params"], f"rank {rank} add_group")
    identical(two, lambda r: r["add_group"]["params"], "add_group")


def test_gradients_written_into_p_grad_are_reduced(two):
    ref = reference("direct", 2)
    assert ref["d_grad_none"]
    for rank, r in enumerate(two):
        d = r["direct"]
        assert d["d_grad_none"], f"rank {rank}: a parameter no rank gave a gradient has one"
        close(d["synchronized"][0], ref["synchronized"][0], f"rank {rank}: p.grad after synchronize()")
        for step, (got, want) in enumerate(zip(d["history"], ref["history"])):
            close(got, want, f"rank {rank} after step {step - 1}")
    for step in range(4):
        identical(two, lambda r: r["direct"]["history"][step], f"direct step {step}")


def test_nan_skip_policy_in_the_native_loop(two):
    ref = reference("nan_skip", 2)
    for rank, r in enumerate(two):
        s = r["nan_skip"]
        assert s["skipped"] == 1, f"rank {rank}: skipped_steps {s['skipped']}"
        for n, t in s["history"][NAN_STEP].items():
            assert torch.equal(t, s["history"][NAN_STEP - 1][n]), f"rank {rank}: NaN step {NAN_STEP} applied ({n})"
        for step in range(STEPS):
            close(s["history"][step], ref["history"][step], f"rank {rank} step {step}")
        assert s["raised"] is not None, f"rank {rank}: nan_policy='raise' did not raise FloatingPointError"
    for step in range(STEPS):
        identical(two, lambda r: r["nan_skip"]["history"][step], f"nan_skip step {step}")


def check_option(results, option, world):
    _, rtol, atol_frac = CODECS[option]
    name = f"option_{option}"
    ref = reference(name, world)
    for rank, r in enumerate(results):
        for step, ((before, g, after), (_, want, _)) in enumerate(zip(r[name], ref)):
            scale = max(float(w.abs().max()) for w in want.values())
            close(g, want, f"{option} rank {rank} step {step}: p.grad after synchronize()", atol_frac * scale, rtol)
            # step() applies exactly what synchronize() left in p.grad (SGD, lr 0.1, no momentum)
            close(after, {n: before[n] - 0.1 * g[n] for n in before}, f"{option} rank {rank} step {step}", 1e-7, 1e-6)
    for step in range(3):
        identical(results, lambda r: r[name][step][1], f"{option} step {step} gradient")
        identical(results, lambda r: r[name][step][2], f"{option} step {step} parameters")


@pytest.mark.parametrize("option", list(CODECS))
def test_dist_option_through_synchronize_and_step(two, option):
    check_option(two, option, 2)


def test_singa_methods_keep_working(two):
    ref = reference("singa", 2)
    for rank, r in enumerate(two):
        for step, (got, want) in enumerate(zip(r["singa"], ref)):
            tol = 1e-5 if step < 2 else 2e-4  # step 2 went through fp16
            close(got, want, f"rank {rank} SINGA step {step}", tol, tol)
    for step in range(len(ref)):
        identical(two, lambda r: r["singa"][step], f"singa step {step}")


def test_partial_update_native_equals_singa(two):
    for rank, r in enumerate(two):
        native, singa = r["partial"][True], r["partial"][False]
        for step, (got, want) in enumerate(zip(native, singa)):
            close(got, want, f"rank {rank} partialUpdate step {step}: native vs backward_and_partial_update", 0, 0)
    differs = any(not torch.equal(t, two[1]["partial"][True][0][n]) for n, t in two[0]["partial"][True][0].items())
    assert differs, "ranks hold equal parameters after a partial update: nothing was local"


def test_spec_loop_on_three_ranks(three):
    ref = reference("spec_loop", 3)
    assert ref["scales"][INF_STEP] == ref["scales"][INF_STEP - 1] / 2
    for rank, r in enumerate(three):
        s = r["spec_loop"]
        assert s["scales"] == ref["scales"] and s["lr"] == pytest.approx(ref["lr"]), (rank, s["scales"], s["lr"])
        for step in range(STEPS):
            close(s["params"][step], ref["params"][step], f"rank {rank} step {step}")
    for step in range(STEPS):
        identical(three, lambda r: r["spec_loop"]["params"][step], f"spec loop step {step}")


def test_fp16_on_three_ranks(three):
    check_option(three, "fp16", 3)


# --- disagreement: a StepMismatchError on every rank, never a hang ------------------------------


def names_rank(message, rank):
    return re.search(rf"(?<![\w.]){rank}(?![\w.])", message) is not None


@pytest.mark.parametrize("kind,world", [("option", "three"), ("frozen", "two")])
def test_disagreeing_ranks_raise_step_mismatch_everywhere(kind, world, request):
    results = request.getfixturevalue(world)
    for rank, world_result in enumerate(results):
        r = world_result[f"mismatch_{kind}"]
        assert r["message"] is not None, f"rank {rank}: no StepMismatchError"
        assert r["runtime_error"] and r["seconds"] < 60, r
        msg = r["message"]
        for other in range(len(results)):
            assert names_rank(msg, other), f"rank {rank}'s message does not name rank {other}: {msg}"
        if kind == "option":
            assert "fp16" in msg and "plain" in msg, msg
        else:
            assert any(w in msg.lower() for w in ("trainable", "frozen", "requires_grad", "fc1.weight")), msg
