"""Train the reference guide's MNIST CNN with troupe.DistOpt.

The same script runs under every launcher, unedited:

    troupe run -n 2 examples/mnist_cnn.py --epochs 3
    torchrun --nproc-per-node 2 examples/mnist_cnn.py
    mpiexec -n 2 python examples/mnist_cnn.py
    python examples/mnist_multiprocess.py 2        # the Ticket + multiprocessing pattern
    python examples/mnist_cnn.py                   # one process

`--dist-option powerSGD --powersgd-rank 2` sends each weight matrix's gradient as rank-2 factors
(PowerSGD, as torch's powerSGD_hook; docs/compression.md).
`--graph` compiles the whole train_one_batch (SINGA's graph mode: forward, backward with the
bucketed all-reduce inside its graph, optimizer update; see docs/graph.md).
`--loop torch` trains with the PyTorch loop instead of SINGA's train_one_batch: gradient
accumulation under `sgd.no_sync()` (`--accum K`), `sgd.synchronize()`, clipping
(`--clip`), `torch.amp.GradScaler` with bf16 autocast (`--amp`), and an LR scheduler
built on the DistOpt (`--lr-step`).
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

import troupe
from pathlib import Path
from troupe.reliability import checkpoint
from troupe.script.metrics import Throughput, accuracy, progress, reduce_variable


INPUT_SHAPE = (1, 28, 28)
"""One sample's shape (what `troupe plan examples/mnist_cnn.py` profiles the model with)."""


class CNN(troupe.Model):
    """conv 5x5x20 -> maxpool 2 -> conv 5x5x50 -> maxpool 2 -> fc 500 -> relu -> fc 10."""

    def __init__(self, num_classes: int = 10, num_channels: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(num_channels, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.linear1 = nn.Linear(4 * 4 * 50, 500)
        self.linear2 = nn.Linear(500, num_classes)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.conv1(x)), 2)
        y = F.max_pool2d(F.relu(self.conv2(y)), 2)
        y = F.relu(self.linear1(y.flatten(1)))
        return self.linear2(y)

    def train_one_batch(self, x, y, dist_option="plain", spars=None):
        out = self.forward(x)
        loss = F.cross_entropy(out, y)
        self.optimizer.update(loss, dist_option, spars)
        return out, loss


PARTITIONS = {"data": 0, "hybrid": {"conv*": 0, "linear*": 1}, "model": 1, "auto": "auto"}
"""--partition: the partition_dim of each layer (SINGA 0.x; troupe.partition)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    # The reference uses 0.005 for 10 epochs; 0.05 reaches its 0.989 within 3 (README, `make train`).
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--data", default=None, help="directory with the MNIST IDX files (default: offline copy)")
    p.add_argument("--dist-option", default="plain", help=f"one of {sorted(troupe.DIST_OPTIONS)}")
    p.add_argument("--spars", type=float, default=None)
    p.add_argument("--powersgd-rank", type=int, default=None,
                   help="--dist-option powerSGD: rank of each matrix gradient's factors (default 1)")
    p.add_argument("--powersgd-start", type=int, default=None,
                   help="--dist-option powerSGD: plain all-reduce steps before compression starts (default 0)")
    p.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
    p.add_argument("--train-size", type=int, default=None, help="use only the first N training samples")
    p.add_argument("--test-size", type=int, default=None, help="evaluate on only the first N test samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    p.add_argument("--graph", action="store_true",
                   help="SINGA's graph mode: train_one_batch compiled whole (forward, backward with the all-reduce "
                        "inside its graph, update); dist_option plain, fp32, fp16 or bf16 (docs/graph.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (troupe run --checkpoint-dir)")
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--loop", choices=("singa", "torch"), default="singa",
                   help="singa: model.train_one_batch; torch: backward / synchronize / clip / step")
    p.add_argument("--accum", type=int, default=1, help="--loop torch: micro-batches per step (no_sync)")
    p.add_argument("--clip", type=float, default=None, help="--loop torch: clip_grad_norm_ to this")
    p.add_argument("--amp", action="store_true", help="--loop torch: bf16 autocast and a GradScaler")
    p.add_argument("--lr-step", type=int, default=None, help="--loop torch: StepLR(step_size=N steps, gamma=0.5)")
    p.add_argument("--partition", choices=sorted(PARTITIONS), default=None,
                   help="data: every rank the whole model; hybrid: convolutions split the batch, linear layers "
                        "their output features (Krizhevsky's 'one weird trick'); model: every layer its features; "
                        "auto: the planner's pick (troupe plan) for the link given by --link (default: the "
                        "cluster's partition_dim under --cluster, else data)")
    p.add_argument("--link", default="loopback",
                   help="--partition auto: the link between hosts (1gbit, 100mbit, ...; job: this job's costs "
                        "measured in the step)")
    p.add_argument("--workers-per-group", type=int, default=None,
                   help="--partition hybrid/model: ranks that compute one model replica (default: all; "
                        "under --cluster its nworkers_per_group, under --elastic the worker group's size)")
    p.add_argument("--crash-at-step", type=int, default=None, help=argparse.SUPPRESS)  # fault injection for tests
    args = p.parse_args(argv)
    if args.graph and (args.loop != "singa" or args.dist_option not in ("plain", "fp32", "fp16", "bf16")):
        p.error(f"--graph compiles SINGA's train_one_batch with dist_option plain, fp32, fp16 or bf16; "
                f"got --loop {args.loop} --dist-option {args.dist_option}")
    return args


def train_mnist_cnn(args, ticket=None, local_rank=None, world_size=None):
    """The reference's training function; the Ticket arguments come from the multiprocessing launcher."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = CNN()
    if args.partition != "data":
        world = troupe.init(ticket, local_rank, world_size)
        plan = PARTITIONS[args.partition] if args.partition else None  # None: the cluster's partition_dim, if any
        # under a cluster its nworkers_per_group, under --elastic the elastic worker group's size
        k = args.workers_per_group or (None if world.settings.cluster or world.membership.elastic else world.world_size)
        # "auto" profiles the model on a batch of this shape (its values do not matter)
        troupe.partition(model, plan, k, sample=torch.zeros(args.batch_size, 1, 28, 28), link=args.link)
        rows = troupe.partition.describe(model)
        if world.rank == 0 and any(r.partition_dim for r in rows):
            dims = " ".join(f"{r.name}:{r.partition_dim}" for r in rows if r.local_params)
            print(f"partition ({args.partition or 'cluster'}): {dims}", flush=True)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-5)
    sgd = troupe.DistOpt(sgd, ticket=ticket, local_rank=local_rank, world_size=world_size,
                         dist_option=args.dist_option, spars=args.spars, powersgd_rank=args.powersgd_rank,
                         powersgd_start=args.powersgd_start)
    model.set_optimizer(sgd)
    torch_loop = TorchLoop(model, sgd, args) if args.loop == "torch" else None
    dev = sgd.device
    model.to(dev)
    main = sgd.global_rank == 0

    train_x, train_y, test_x, test_y = troupe.data.load_mnist(args.data)
    if args.train_size:
        train_x, train_y = train_x[: args.train_size], train_y[: args.train_size]
    if args.test_size:
        test_x, test_y = test_x[: args.test_size], test_y[: args.test_size]
    bs = args.batch_size
    # Each rank its share of one fresh permutation per epoch; rank and world size are the DistOpt's
    # data-parallel ones (under --partition every worker of a group still feeds its own share).
    train = troupe.data.loader((train_x, train_y), bs, seed=args.seed, tail="drop", drop_last=True)
    test_x, test_y = troupe.data.partition(test_x, test_y, sgd.global_rank, sgd.world_size)
    num_train_batch = len(train)
    if args.max_steps:
        num_train_batch = min(num_train_batch, args.max_steps)
    num_test_batch = max(len(test_x) // bs, 1)
    if num_train_batch == 0:
        raise ValueError(f"--batch-size {bs} is larger than this rank's {len(train.sampler)} training samples")
    if main:
        print(f"{sgd}: {len(train.sampler)} training samples per rank, batch {bs}", flush=True)

    ckpt_dir, resume = checkpoint.from_env()
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else ckpt_dir
    resume = "yes" if args.resume else resume
    step, start_epoch, start_batch, partial, resumed_at = 0, 0, 0, (0, 0.0), None
    if resume != "no" and ckpt_dir is not None:
        found = checkpoint.latest(ckpt_dir)
        if found is None and resume == "yes":
            raise FileNotFoundError(f"--resume: no complete checkpoint in {ckpt_dir}")
        if found is not None:
            state = checkpoint.load(found, model, sgd)
            step, start_epoch, start_batch = state["step"], state["epoch"], state["batch"]
            resumed_at = step
            train.sampler.load_state_dict(state["sampler"])  # the epoch's permutation, after its first batches
            partial = (state["train_correct"], state["train_loss"])
            if main:
                print(f"Resumed from {found} (epoch {start_epoch}, batch {start_batch})", flush=True)

    # troupe run --elastic: a restarted worker copies a healthy one's state here, live (None otherwise)
    rejoined = troupe.track(model=model, optimizer=sgd, sampler=train.sampler)
    if rejoined:
        where = train.sampler.state_dict()
        step, start_epoch, resumed_at = rejoined, where["epoch"], rejoined
        start_batch = where["position"] // (sgd.world_size * bs)
        print(f"rank {sgd.global_rank} rejoined at step {step} (epoch {start_epoch}, batch {start_batch})", flush=True)
    # After troupe.track: under --elastic a partitioned model's group computes only once it has joined the job
    model.compile([train_x[:bs].to(dev)], is_train=True, use_graph=args.graph, sequential=True)

    history = []
    for epoch in range(start_epoch, args.epochs):
        if main:
            print(f"Starting Epoch {epoch}:", flush=True)
        model.train()
        train.sampler.set_epoch(epoch)  # resuming: keeps the position load_state_dict gave
        batches = iter(train)
        first = start_batch if epoch == start_epoch else 0
        train_correct, train_loss = partial if epoch == start_epoch else (0, 0.0)
        speed = Throughput()
        for b in progress(range(first, num_train_batch), desc=f"epoch {epoch}", enabled=main and not args.quiet):
            if ckpt_dir is not None and step % args.checkpoint_every == 0 and step not in (0, resumed_at):
                extra = dict(epoch=epoch, batch=b, sampler=train.sampler.state_dict(), train_correct=train_correct,
                             train_loss=train_loss)
                checkpoint.save(ckpt_dir, step, model, sgd, extra)
            if step == args.crash_at_step and resumed_at is None and sgd.global_rank == 1:
                os._exit(17)  # simulate a dying process (tests only)
            tx, ty = next(batches)
            tx, ty = tx.to(dev), ty.to(dev)
            if torch_loop is None:
                out, loss = model.train_one_batch(tx, ty, args.dist_option, args.spars)
            else:
                out, loss = torch_loop.step(tx, ty)
            train_correct += accuracy(out, ty)
            train_loss += loss.item()
            speed.add(bs)
            step += 1
        rate = speed.rate()
        train_correct = reduce_variable(train_correct)
        train_loss = reduce_variable(train_loss)
        train_acc = train_correct / reduce_variable(num_train_batch * bs)  # over the ranks train_correct was

        model.eval()
        test_correct = 0
        with torch.no_grad():
            for b in range(num_test_batch):
                tx, ty = test_x[b * bs : (b + 1) * bs].to(dev), test_y[b * bs : (b + 1) * bs].to(dev)
                test_correct += accuracy(model(tx), ty)
        test_total = reduce_variable(min(num_test_batch * bs, len(test_x)))
        test_acc = reduce_variable(test_correct) / test_total
        if main:
            print(f"Training loss = {train_loss:f}, training accuracy = {train_acc:f}", flush=True)
            print(f"Evaluation accuracy = {test_acc:f}, {rate:.0f} samples/s", flush=True)
        # TensorBoard (troupe run --tensorboard DIR) beside troupe's per-step scalars; rank 0 writes
        troupe.log({"epoch/train_loss": train_loss, "epoch/train_accuracy": train_acc,
                    "epoch/eval_accuracy": test_acc}, step)
        history.append({"epoch": epoch, "train_loss": train_loss, "train_acc": train_acc, "eval_acc": test_acc})
    return model, history


class TorchLoop:
    """The PyTorch loop on a DistOpt: micro-batches under no_sync, synchronize, clip, GradScaler, scheduler."""

    def __init__(self, model, sgd, args):
        self.model, self.sgd, self.args = model, sgd, args
        self.device = sgd.device.type  # autocast and the scaler on the device the model trains on
        self.scaler = torch.amp.GradScaler(self.device, enabled=args.amp)
        self.sched = torch.optim.lr_scheduler.StepLR(sgd, args.lr_step, gamma=0.5) if args.lr_step else None

    def step(self, x, y):
        """One optimizer step on batch (x, y), cut into --accum micro-batches; returns (outputs, loss)."""
        k = self.args.accum
        outs, total = [], 0.0
        for i, (mx, my) in enumerate(zip(x.chunk(k), y.chunk(k))):
            last = i == k - 1
            with nullcontext() if last else self.sgd.no_sync():  # only the last backward communicates
                with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.args.amp):
                    out = self.model(mx)
                    loss = F.cross_entropy(out.float(), my) * (len(my) / len(y))
                self.scaler.scale(loss).backward()
            outs.append(out.detach().float())
            total += loss.detach()
        self.sgd.synchronize()  # p.grad: the mean over ranks
        if self.args.clip is not None:
            self.scaler.unscale_(self.sgd)
            # troupe's counts every slice of a partitioned layer once, on every rank (torch's sees this rank's)
            troupe.clip_grad_norm_(self.model.parameters(), self.args.clip)
        self.scaler.step(self.sgd)
        self.scaler.update()
        self.sgd.zero_grad()
        if self.sched is not None:
            self.sched.step()
        return torch.cat(outs), total


def main(argv=None):
    start = time.perf_counter()
    args = parse_args(argv)
    _, history = train_mnist_cnn(args)
    if troupe.info().global_rank == 0:
        print(f"Finished {len(history)} epoch(s) in {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
