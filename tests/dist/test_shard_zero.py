"""Sharded optimizer state and gradients (``DistOpt(opt, shard="optimizer"|"gradients")``) on real Gloo
ranks, against one process training the whole model on the combined batch.

One world per world size runs every case (shard mode x optimizer) on a model with a tied embedding,
a frozen layer and very uneven parameter sizes, with accumulation under no_sync and clipping over the
whole model, and reports what each rank holds; the reference runs in the test process. The world of 4
also runs 2 worker groups of 2 (HSDP: ``groups=2``), whose ranks hold 1/2 of the state each and send
1/2 of the gradients across groups.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.world import run_world

STEPS, MICRO, BATCH = 3, 2, 4  # per rank: MICRO micro-batches of BATCH samples per step
VOCAB, DIM = 37, 12
CASES = [(mode, opt, loop) for mode in ("optimizer", "gradients") for opt, loop in
         (("sgd", "loop"), ("adamw", "loop"), ("adamw", "scaler"), ("sgd", "singa"))]
"""(shard mode, optimizer, script shape): the PyTorch loop with accumulation and clipping; the same with
torch's GradScaler and an overflow on one rank; SINGA's ``sgd(loss)``."""
CASES.append(("cluster", "adamw", "loop"))
"""SINGA's AllReduce framework with ``shard: gradients`` in its cluster block (``TROUPE_CLUSTER``): ZeRO-2."""
HSDP_CASES = [("optimizer", "adamw", "loop", 2), ("gradients", "adamw", "scaler", 2)]
"""(shard mode, optimizer, script shape, worker groups): the world of 4 ranks only."""
INF_STEP = 1
"""The GradScaler case's step whose loss overflows on rank 0 only (every rank must skip it)."""


class TiedLM(nn.Module):
    """An embedding tied to the output layer, a frozen layer, one big and several tiny tensors."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.big = nn.Linear(DIM, 5 * DIM)
        self.small = nn.Linear(5 * DIM, DIM, bias=False)
        self.scale = nn.Parameter(torch.ones(1))
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=True)
        self.out.weight = self.embed.weight

    def forward(self, x):
        h = self.frozen(self.embed(x).mean(1))
        h = self.norm(self.small(torch.tanh(self.big(h))) * self.scale)
        return self.out(h)


def make(opt_name: str):
    torch.manual_seed(0)
    model = TiedLM()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=0.01)
    return model, opt


def overflow(model: TiedLM, now: bool):
    """An infinite gradient in one one-element parameter only (on one rank: only its owner's chunk sees it)."""
    return model.scale.sum() * float("inf") if now else 0.0


def batches(world_size: int):
    g = torch.Generator().manual_seed(1)
    n = STEPS * MICRO * BATCH * world_size
    return torch.randint(0, VOCAB, (n, 3), generator=g), torch.randint(0, VOCAB, (n,), generator=g)


def rank_slice(step: int, micro: int, rank: int, world_size: int) -> slice:
    start = ((step * MICRO + micro) * world_size + rank) * BATCH
    return slice(start, start + BATCH)


def train_case(rank: int, world_size: int, mode: str, opt_name: str, loop: str, groups: int | None = None) -> dict:
    import os

    import troupe
    from troupe.cluster.configuration.presets import preset

    model, opt = make(opt_name)
    if mode == "cluster":  # the co-located servers of one AllReduce group, sharded by the cluster block
        os.environ["TROUPE_CLUSTER"] = preset("allreduce", world_size, shard="gradients").to_json()
        try:
            sgd = troupe.DistOpt(opt, bucket_size=200, first_bucket_size=100)
        finally:
            del os.environ["TROUPE_CLUSTER"]
        assert sgd.strategy.mode == "gradients", sgd.strategy
    else:
        sgd = troupe.DistOpt(opt, shard=mode, bucket_size=200, first_bucket_size=100, groups=groups)
    across = sgd.strategy.across
    crossed = 0 if across is None else across.traffic["all_reduce"].payload_bytes
    sched = torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if loop == "scaler" else None
    x, y = batches(world_size)
    norms, scales = [], []
    for step in range(STEPS):
        if loop == "singa":  # one backward of the rank's MICRO micro-batches together, then the step
            sl = [rank_slice(step, m, rank, world_size) for m in range(MICRO)]
            sgd(F.cross_entropy(model(torch.cat([x[s] for s in sl])), torch.cat([y[s] for s in sl])))
            continue
        for micro in range(MICRO):
            sl = rank_slice(step, micro, rank, world_size)
            loss = F.cross_entropy(model(x[sl]), y[sl]) / MICRO
            if scaler is not None:
                loss = scaler.scale(loss + overflow(model, step == INF_STEP and rank == 0))
            if micro < MICRO - 1:
                with sgd.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if scaler is not None:
            scaler.unscale_(sgd)
        norms.append(float(troupe.clip_grad_norm_(model.parameters(), 0.5)))
        if scaler is not None:
            scaler.step(sgd)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            sgd.step()
        sched.step()
        sgd.zero_grad()
    state = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    held = [p.numel() for g in opt.param_groups for p in g["params"] if p.requires_grad]
    grads = sum(g.numel() for g in sgd.strategy.grads)
    buckets = sum(0 if b.buffer is None else b.buffer.numel() for b in sgd.reducer.buckets)
    if across is not None:  # bytes handed to the cross-group all-reduce, against the gradients' and flags'
        crossed = across.traffic["all_reduce"].payload_bytes - crossed
        gradient = sum(b.padded for b in sgd.reducer.buckets) * 4
        flags = sum(b.size - b.padded for b in sgd.reducer.buckets) * 4
        crossed = {"per_step": crossed / STEPS, "gradient": gradient, "flags": flags}
    refusals = []
    if loop == "singa":  # what a sharded DistOpt cannot do: one line each
        for call in (lambda: sgd.update(F.cross_entropy(model(x[:2]), y[:2]), "fp16"),
                     lambda: sgd.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]}),
                     lambda: sgd.join().__enter__(),
                     lambda: sgd.compile_step(model, lambda a, b: F.cross_entropy(model(a), b))):
            try:
                call()
                refusals.append(None)
            except ValueError as e:
                refusals.append(str(e))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms,
            "scales": scales, "state": state, "held": sum(held), "grads": grads, "buckets": buckets,
            "refusals": refusals, "crossed": crossed}


def world(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    cases = CASES + (HSDP_CASES if world_size == 4 else [])
    return {case: train_case(rank, world_size, *case) for case in cases}


def reference(opt_name: str, loop: str, world_size: int) -> tuple[dict, list[float], list[float]]:
    model, opt = make(opt_name)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if loop == "scaler" else None
    x, y = batches(world_size)
    norms, scales = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            losses = [F.cross_entropy(model(x[rank_slice(step, micro, r, world_size)]),
                                      y[rank_slice(step, micro, r, world_size)]) for r in range(world_size)]
            loss = sum(losses) / (world_size * MICRO)
            if scaler is not None:
                loss = scaler.scale(loss + overflow(model, step == INF_STEP))
            loss.backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if loop != "singa":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
        if loop != "singa":
            sched.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms, scales


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, run_world(world, request.param, timeout=120)


def ids(case) -> str:
    return "-".join(map(str, case))


@pytest.mark.parametrize("case", CASES + HSDP_CASES, ids=ids)
def test_equals_one_process_on_the_combined_batch(ranks, case):
    world_size, results = ranks
    if case not in results[0]:
        pytest.skip("HSDP needs 2 groups of 2 ranks: it runs in the 4-rank world only")
    ref, ref_norms, ref_scales = reference(case[1], case[2], world_size)
    for r, res in enumerate(results):
        got = res[case]
        for name, value in ref.items():
            assert torch.allclose(got["params"][name], value, atol=1e-5, rtol=1e-5), (r, name)
        finite = [n for n in ref_norms if n == n and n != float("inf")]
        assert [n for n in got["norms"] if n == n and n != float("inf")] == pytest.approx(finite, rel=1e-5), r
        assert got["scales"] == ref_scales, r  # the overflow step skipped on every rank: the scale halved once
    if case[2] == "scaler":
        assert ref_scales[INF_STEP] == ref_scales[0] / 2


def test_what_a_sharded_distopt_cannot_do_is_refused_in_one_line(ranks):
    _, results = ranks
    for mode in ("optimizer", "gradients"):
        fp16, add, join, graph = results[0][(mode, "sgd", "singa")]["refusals"]
        assert f"dist_option 'fp16' cannot run with shard='{mode}'" in fp16
        assert "add_param_group is not available with shard=" in add
        assert "join() cannot shadow with shard=" in join
        assert "graph mode" in graph and "not available with shard=" in graph


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_each_rank_holds_its_share(ranks, case):
    world_size, results = ranks
    model, _ = make(case[1])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    slots = 2 if case[1] == "adamw" else 1  # exp_avg + exp_avg_sq, or the momentum buffer
    held = [res[case]["held"] for res in results]
    assert sum(held) == trainable  # the parts cover every element once
    for res in results:
        # within one bucket's padding (k - 1 elements per bucket) of 1/k
        assert abs(res[case]["held"] - trainable / world_size) <= 4 * (world_size - 1)
        assert res[case]["state"] == slots * res[case]["held"]
        if case[0] in ("gradients", "cluster"):
            assert res[case]["buckets"] == 0  # the full gradients are freed after each reduction
            assert res[case]["grads"] <= trainable / world_size + 4 * world_size
        else:
            assert res[case]["buckets"] > trainable


@pytest.mark.parametrize("case", HSDP_CASES, ids=ids)
def test_worker_groups_shard_inside_and_send_one_kth_across(ranks, case):
    world_size, results = ranks
    if case not in results[0]:
        pytest.skip("HSDP needs 2 groups of 2 ranks: it runs in the 4-rank world only")
    k = world_size // case[3]
    model, _ = make(case[1])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    held = [res[case]["held"] for res in results]
    assert sum(held[:k]) == sum(held[k:]) == trainable  # each group covers every element once
    assert held[:k] == held[k:]  # rank j of every group holds the same chunks
    for res in results:
        assert abs(res[case]["held"] - trainable / k) <= 4 * (k - 1)
        assert res[case]["state"] == 2 * res[case]["held"]  # AdamW: two slots of its own part only
        crossed = res[case]["crossed"]
        # every step each rank sends its chunk (1/k of the bucket's gradients) and the flags across groups
        assert crossed["per_step"] == crossed["gradient"] / k + crossed["flags"]
        if case[0] == "gradients":
            assert res[case]["buckets"] == 0
