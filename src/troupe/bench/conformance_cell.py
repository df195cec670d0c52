"""One cell of the conformance matrix: a small script of one shape, trained under one regime, by any launcher.

    python conformance_cell.py OUT --shape torch --regime fp16              # under troupe run, torchrun, mpiexec,
                                                                            # srun or the env:// variables alone
    python conformance_cell.py OUT --shape singa --regime plain --ticket 2  # the reference's Ticket + multiprocessing

The script is what a user brings, not troupe's own examples (`troupe.bench.suites.conformance` names each
shape). Worker 0 saves its final model (the whole of it, also where partitioned or sharded) to OUT/model.pt.
The regime comes from the launcher where it is a cluster or a sharded DistOpt (``--framework``, ``--shard``,
TROUPE_CLUSTER, TROUPE_SHARD); a dist_option, troupe.shard and troupe.partition are the script's own choice.
Every sample of the data is seen once per epoch; the global batch of a step is the same whatever the number of
workers, so a synchronous regime ends where one process does with the whole batch.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

import troupe

SHAPES = ("singa", "torch", "ddp", "tied", "compiled", "eval")
DIST_OPTIONS = ("plain", "fp16", "bf16", "partialUpdate", "sparseTopK", "sparseThreshold", "powerSGD")
STEPS, BATCH = 8, 16
"""Steps of the run and the global batch of a step (every launcher and regime alike)."""
VOCAB = 16


class Singa(troupe.Model):
    """SINGA's Model: train_one_batch calls the DistOpt with the loss (sgd(loss))."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net(x)

    def train_one_batch(self, x, y):
        out = self.forward(x)
        loss = F.mse_loss(out, y)
        self.optimizer(loss)
        return out, loss


class Tied(nn.Module):
    """A language-model head tied to its embedding (one Parameter, two modules), with a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.norm(self.emb(x)))


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def build(shape: str) -> nn.Module:
    """The shape's model, the same on every process (rank 0's reaches the others anyway)."""
    torch.manual_seed(0)
    return {"singa": Singa, "tied": Tied}.get(shape, mlp)()


def dataset(shape: str) -> tuple[torch.Tensor, torch.Tensor]:
    """STEPS x BATCH samples with a learnable target: tokens -> (3 token + 1) mod VOCAB, or x -> x W (+ noise)."""
    g = torch.Generator().manual_seed(1)
    if shape == "tied":
        x = torch.randint(0, VOCAB, (STEPS * BATCH,), generator=g)
        return x, (3 * x + 1) % VOCAB
    x = torch.randn(STEPS * BATCH, 8, generator=g)
    return x, x @ torch.randn(8, 4, generator=g) + 0.05 * torch.randn(STEPS * BATCH, 4, generator=g)


def loss_of(shape: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y) if shape == "tied" else F.mse_loss(out, y)


def my_batches(shape: str, rank: int, world: int):
    """This worker's share of each step's global batch (contiguous rows)."""
    x, y = dataset(shape)
    per = BATCH // world
    for step in range(STEPS):
        rows = slice(step * BATCH + rank * per, step * BATCH + (rank + 1) * per)
        yield x[rows], y[rows]


def prepare(model: nn.Module, regime: str, shape: str) -> nn.Module:
    """What the script does to its model for the regimes that change it (before the optimizer)."""
    if regime == "partition":  # hybrid: the first layer splits the batch, the last its output features
        last = "net.2" if shape == "singa" else "head" if shape == "tied" else "2"
        troupe.partition(model, {last: 1}, 2)
    elif regime == "shard-parameters":
        model = troupe.shard(model)
    return model


def optimizer(model: nn.Module, shape: str) -> torch.optim.Optimizer:
    if shape != "tied":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for _, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=0.05)


def dist_opt(opt: torch.optim.Optimizer, regime: str, joins: dict) -> troupe.DistOpt:
    option = regime if regime in DIST_OPTIONS else "plain"
    spars = {"sparseTopK": 0.5, "sparseThreshold": 0.01}.get(option)
    return troupe.DistOpt(opt, dist_option=option, spars=spars, **joins)


def torch_loop(model, opt, batches, shape, regime: str, accum: int = 2) -> None:
    """Micro-batches under no_sync, synchronize, GradScaler, torch's clip_grad_norm_, StepLR (under every regime:
    on a partitioned model or a sharded DistOpt's parameters torch's is troupe.clip_grad_norm_)."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        for i, (xs, ys) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            with nullcontext() if i == accum - 1 else opt.no_sync():
                scaler.scale(loss_of(shape, model(xs), ys) / accum).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()


def simple_loop(model, opt, batches, shape, evaluate: bool = False) -> None:
    """zero_grad, backward, step; with `evaluate`, a whole-data loss under eval() and no_grad every other step."""
    x_all, y_all = dataset(shape)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss_of(shape, model(x), y).backward()
        opt.step()
        if evaluate and step % 2 == 1:
            model.eval()
            with torch.no_grad():
                loss_of(shape, model(x_all), y_all).item()
            model.train()


def save(model: nn.Module, opt: troupe.DistOpt, regime: str, out: str) -> None:
    """Worker 0 writes the whole model (gathered where it is partitioned or sharded: every rank calls that)."""
    whole = troupe.full_state_dict(model) if regime in ("partition", "shard-parameters") else model.state_dict()
    if opt.global_rank == 0:
        state = {k.removeprefix("_orig_mod."): v.detach().clone() for k, v in whole.items()}
        torch.save({"model": state, "world_size": opt.world_size, "launcher": troupe.info().launcher},
                   os.path.join(out, "model.pt"))


def ddp_shaped(out: str, regime: str) -> None:
    """The DDP tutorial's shape: its own process group, DistributedSampler, its own torch.save snapshot."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    data = TensorDataset(*dataset("ddp"))
    sampler = DistributedSampler(data, shuffle=False)
    loader = DataLoader(data, batch_size=BATCH // sampler.num_replicas, sampler=sampler)
    model = prepare(build("ddp"), regime, "ddp")
    opt = dist_opt(optimizer(model, "ddp"), regime, {})
    for x, y in loader:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    if dist.get_rank() == 0:
        torch.save({"MODEL_STATE": model.state_dict()}, os.path.join(out, "snapshot.pt"))
    save(model, opt, regime, out)
    dist.destroy_process_group()


def train(out: str, shape: str, regime: str, ticket=None, local_rank=None, world_size=None) -> None:
    torch.set_num_threads(1)
    if shape == "ddp":
        return ddp_shaped(out, regime)
    joins = {"ticket": ticket, "local_rank": local_rank, "world_size": world_size} if ticket else {}
    if joins and regime in ("partition", "shard-parameters"):
        troupe.init(ticket, local_rank, world_size)
    model = prepare(build(shape), regime, shape)
    if shape == "compiled":
        # TROUPE_CELL_COMPILE_BACKEND=aot_eager: dynamo's graphs and AOT autograd's backward, without inductor's
        # code generation (the suite's covering sample: 2-3 times cheaper; the matrix compiles with inductor)
        model = torch.compile(model, backend=os.environ.get("TROUPE_CELL_COMPILE_BACKEND", "inductor"))
    opt = dist_opt(optimizer(model, shape), regime, joins)
    batches = my_batches(shape, opt.global_rank, opt.world_size)
    if shape == "singa":
        model.set_optimizer(opt)
        x0, _ = dataset(shape)
        model.compile([x0[:1]], is_train=True)
        for x, y in batches:
            model(x, y)
    elif shape == "torch":
        torch_loop(model, opt, batches, shape, regime)
    else:
        simple_loop(model, opt, batches, shape, evaluate=shape == "eval")
    save(model, opt, regime, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--regime", default="plain", help="a dist_option, 'partition', 'shard-parameters', or any "
                                                     "other name (the launcher chose the regime)")
    p.add_argument("--ticket", type=int, default=None, metavar="N", help="start N processes with a troupe.Ticket")
    args = p.parse_args(argv)
    if args.ticket is None:
        train(args.out, args.shape, args.regime)
        return 0
    ticket = troupe.Ticket()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=train, args=(args.out, args.shape, args.regime, ticket, r, args.ticket))
             for r in range(args.ticket)]
    for proc in procs:
        proc.start()
    return troupe.wait_all(procs)


if __name__ == "__main__":
    sys.exit(main())
