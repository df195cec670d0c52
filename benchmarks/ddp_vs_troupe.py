"""Step time of troupe's DistOpt vs PyTorch DistributedDataParallel, side by side in one world.

Both strategies live in the same processes on the same Gloo process group, train the
same model (separate copies, same initial weights) on the same batches with the same
optimizer, and take turns: every repetition runs each strategy once (warm-up steps,
then timed steps), and the order alternates between repetitions (A B, B A, A B, ...)
so slow drift of the machine's load falls on both equally. The ratio troupe/DDP is
taken per repetition (neighbouring runs) and its median over repetitions reported.

    troupe run -n 2 --threads 1 benchmarks/ddp_vs_troupe.py                       # MNIST CNN, 7 reps
    troupe run -n 2 --threads 1 benchmarks/ddp_vs_troupe.py --sweep 2**12,2**16,2**19,all
    troupe run -n 2 --threads 1 benchmarks/ddp_vs_troupe.py --model resnet18 --data synthetic --batch-size 16

Prints a markdown table on rank 0. A bucket size may be written as an int, as ``2**k``
or as ``all`` (one bucket for every parameter).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

import troupe
from troupe.sync.bucket import DEFAULT_BUCKET_SIZE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))
from mnist_cnn import CNN  # noqa: E402  (the example's model, unchanged)

from resnet import resnet18  # noqa: E402  (benchmarks/resnet.py, next to this file)

HEADER = "| strategy | buckets | step ms (median) | spread (min-max) |"
"""The start of the table's header line (what the smoke test looks for)."""


def parse_bucket(text: str) -> int | str:
    """``65536``, ``2**16`` or ``all``."""
    text = text.strip()
    if text == "all":
        return "all"
    if text.startswith("2**"):
        return 2 ** int(text[3:])
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"bucket size must be >= 1 element, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["cnn", "resnet18"], default="cnn")
    p.add_argument("--data", choices=["mnist", "synthetic"], default="mnist",
                   help="real MNIST (troupe.data.load_mnist) or random images; resnet18 always uses synthetic")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--steps", type=int, default=50, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before each repetition")
    p.add_argument("--reps", type=int, default=7, help="repetitions of every strategy")
    p.add_argument("--schedule", choices=["step", "run"], default="step",
                   help="alternate strategies every step (default) or every run of warm-up + timed steps")
    p.add_argument("--bucket-size", type=parse_bucket, default=DEFAULT_BUCKET_SIZE,
                   help=f"troupe's bucket size in elements (default DEFAULT_BUCKET_SIZE = {DEFAULT_BUCKET_SIZE})")
    p.add_argument("--sweep", type=lambda s: [parse_bucket(t) for t in s.split(",")], default=None,
                   help="comma-separated troupe bucket sizes to compare (replaces --bucket-size)")
    p.add_argument("--no-ddp", action="store_true", help="troupe only (ratios then relative to the first strategy)")
    p.add_argument("--local", action="store_true", help="also time the model with no communication at all")
    p.add_argument("--ddp-bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (its default 25)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="also print every repetition's step time")
    args = p.parse_args(argv)
    for name in ("batch_size", "steps", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.model == "resnet18":
        args.data = "synthetic"
    return args


# --- the contestants ---------------------------------------------------------------------------


@dataclass
class Strategy:
    """One way to take a training step, with its step times (seconds) per repetition."""

    name: str
    step: Callable[[Tensor, Tensor], None]
    buckets: str = "-"
    times: list[float] = field(default_factory=list)
    """Per repetition: median wall-clock seconds per step (slowest rank)."""
    cpu: list[float] = field(default_factory=list)
    """Per repetition: median CPU seconds per step of this process, all its threads (slowest rank)."""


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)  # every copy starts from the same weights
    return CNN() if args.model == "cnn" else resnet18(num_classes=10)


def make_sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9, weight_decay=1e-5)


def ddp_strategy(args: argparse.Namespace) -> Strategy:
    # troupe syncs buffers once at start, not every forward: make DDP do the same.
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        else {"broadcast_buffers": False}
    )
    model = DDP(build_model(args), bucket_cap_mb=args.ddp_bucket_mb, **no_buffer_sync)
    opt = make_sgd(model)

    step = plain_step(model, opt)

    return Strategy("DDP", step, buckets=f"cap {args.ddp_bucket_mb:g} MB")


def plain_step(model, opt):
    """One ordinary PyTorch step (DDP reduces inside backward; without DDP nothing is sent)."""

    def step(x: Tensor, y: Tensor) -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def troupe_strategy(args: argparse.Namespace, bucket: int | str) -> Strategy:
    model = build_model(args)
    total = sum(p.numel() for p in model.parameters())
    size = total if bucket == "all" else bucket
    # "all": one bucket for the whole model (the first bucket's cap too)
    sgd = troupe.DistOpt(make_sgd(model), bucket_size=size, first_bucket_size=size)
    sgd.sync_parameters(model)

    def step(x: Tensor, y: Tensor) -> None:
        sgd(F.cross_entropy(model(x), y))

    label = "all" if bucket == "all" else (f"2**{size.bit_length() - 1}" if size & (size - 1) == 0 else str(size))
    return Strategy(f"troupe bucket {label}", step, buckets=str(len(sgd.reducer.buckets)))


def local_strategy(args: argparse.Namespace) -> Strategy:
    model = build_model(args)
    opt = make_sgd(model)

    step = plain_step(model, opt)

    return Strategy("local (no communication)", step, buckets="0")


# --- data and timing ---------------------------------------------------------------------------


def make_batches(args: argparse.Namespace, rank: int, world_size: int) -> list[tuple[Tensor, Tensor]]:
    """Enough distinct batches for one run, prepared up front so loading is never timed."""
    n = args.warmup + args.steps
    bs = args.batch_size
    if args.data == "mnist":
        x, y, _, _ = troupe.data.load_mnist()
        x, y = troupe.data.partition(x, y, rank, world_size)
    else:
        shape = (1, 28, 28) if args.model == "cnn" else (3, 32, 32)
        x, y = troupe.data.synthetic(min(n, 64) * bs, shape, seed=args.seed + rank)
    g = torch.Generator().manual_seed(args.seed + rank)
    idx = torch.randperm(len(x), generator=g)
    per_epoch = len(x) // bs
    if per_epoch == 0:
        raise ValueError(f"--batch-size {bs} is larger than this rank's {len(x)} samples")
    return [
        (x[idx[k * bs : (k + 1) * bs]].contiguous(), y[idx[k * bs : (k + 1) * bs]].contiguous())
        for k in (i % per_epoch for i in range(n))
    ]


def timed_step(strategy: Strategy, x: Tensor, y: Tensor) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    strategy.step(x, y)
    return time.perf_counter() - wall, time.process_time() - cpu


def time_rep(strategies: list[Strategy], batches: list[tuple[Tensor, Tensor]], args: argparse.Namespace,
             rep: int) -> None:
    """One repetition of every strategy; appends each one's median step time (wall and CPU).

    Every step is timed alone and the median kept, so a step in which another process
    took the core (this machine is shared) does not move the result as a mean would.
    ``--schedule run``: each strategy runs its warm-up and timed steps, then the next
    (order reversed every other repetition). ``--schedule step``: after every warm-up,
    the strategies take turns step by step (order reversed every other step), so both
    see the same load on the machine.
    """
    n, warmup = args.steps, args.warmup
    clock = torch.zeros(len(strategies), n, 2, dtype=torch.float64)
    order = list(range(len(strategies)))
    if rep % 2:
        order.reverse()
    if args.schedule == "run":
        for k in order:
            for x, y in batches[:warmup]:
                strategies[k].step(x, y)
            dist.barrier()
            for i, (x, y) in enumerate(batches[warmup:]):
                clock[k, i] = torch.tensor(timed_step(strategies[k], x, y))
    else:
        for k in order:
            for x, y in batches[:warmup]:
                strategies[k].step(x, y)
        dist.barrier()
        for i, (x, y) in enumerate(batches[warmup:]):
            for k in order if i % 2 == 0 else order[::-1]:
                clock[k, i] = torch.tensor(timed_step(strategies[k], x, y))
    dist.all_reduce(clock, dist.ReduceOp.MAX)  # steps are in lockstep: the slowest rank sets the pace
    medians = clock.median(dim=1).values
    for k, s in enumerate(strategies):
        s.times.append(medians[k, 0].item())
        s.cpu.append(medians[k, 1].item())


def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(min(values) * scale)}-{fmt.format(max(values) * scale)}"


def table(strategies: list[Strategy], reference: Strategy) -> str:
    rows = [
        f"{HEADER} ratio to {reference.name} (median) | ratio spread (min-max) | CPU ms/step (median) |",
        "|---" * 7 + "|",
    ]
    for s in strategies:
        ratios = [t / r for t, r in zip(s.times, reference.times)]
        rows.append(
            f"| {s.name} | {s.buckets} | {statistics.median(s.times) * 1e3:.2f} | {spread(s.times, 1e3)} | "
            f"{statistics.median(ratios):.3f} | {spread(ratios, fmt='{:.3f}')} | {statistics.median(s.cpu) * 1e3:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = troupe.init()
    if info.world_size < 2:
        raise SystemExit("run me on 2+ ranks: troupe run -n 2 --threads 1 benchmarks/ddp_vs_troupe.py")
    main_rank = info.global_rank == 0
    batches = make_batches(args, info.global_rank, info.world_size)

    # Every rank builds the strategies in the same order (DDP and DistOpt broadcast at construction).
    strategies = [] if args.no_ddp else [ddp_strategy(args)]
    strategies += [troupe_strategy(args, b) for b in (args.sweep or [args.bucket_size])]
    if args.local:
        strategies.append(local_strategy(args))
    if main_rank:
        print(
            f"# {args.model} on {args.data} data, {info.world_size} ranks x {torch.get_num_threads()} thread(s), "
            f"{info.backend}, torch {torch.__version__}; batch {args.batch_size}/rank, "
            f"{args.warmup} warm-up + {args.steps} timed steps, {args.reps} reps, schedule {args.schedule}",
            flush=True,
        )
    for rep in range(args.reps):
        time_rep(strategies, batches, args, rep)
        if main_rank and args.raw:
            print(f"rep {rep}: " + ", ".join(f"{s.name} {s.times[-1] * 1e3:.2f} ms" for s in strategies), flush=True)
    if main_rank:
        print(table(strategies, strategies[0]), flush=True)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: Gloo's worker thread may still be releasing the last
    # collective's tensors, which takes the GIL, and taking it while the interpreter
    # finalizes aborts the process ("terminate called without an active exception",
    # about 1 run in 30 on this machine).
    os._exit(0)


if __name__ == "__main__":
    main()
