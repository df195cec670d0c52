"""Where a training step's time goes, troupe DistOpt vs DDP, phase by phase (MNIST CNN, 2 ranks).

    troupe run -n 2 --threads 1 benchmarks/profile_step.py --steps 200 --bucket-size 2**16

Times, per step and median over steps (slowest rank), with the two strategies taking
turns step by step: forward; backward (for troupe this includes the gradient hooks:
copies into buckets and launching full buckets; for DDP its hooks and the wait for its
all-reduce at the end of backward); troupe's `finish()` split into launching the last
buckets, waiting for the reductions, and unpacking; the optimizer step. Also the bare
cost of one all-reduce of the whole gradient and of copying the gradients once.
Instruments troupe's objects from outside (wraps methods of the instance); no change
to troupe itself.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

import troupe
import troupe.reliability.nonfinite

from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_vs_troupe import build_model, make_batches, make_sgd, parse_args  # noqa: E402


def timed(store: dict[str, float], key: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        store[key] += time.perf_counter() - t
        return out

    return wrapper


def instrument_troupe(args, bucket):
    """A DistOpt step whose phases are timed by wrapping the reducer's and buckets' methods."""
    model = build_model(args)
    total = sum(p.numel() for p in model.parameters())
    sizes = {"bucket_size": total, "first_bucket_size": total} if bucket == "all" else {"bucket_size": bucket}
    sgd = troupe.DistOpt(make_sgd(model), **sizes)
    sgd.sync_parameters(model)
    red = sgd.reducer
    phases: dict[str, float] = defaultdict(float)
    for b in red.buckets:
        b.add_grad = timed(phases, "  hooks: copy into bucket", b.add_grad)
        b.seal = timed(phases, "  seal (zero unused slots, write flags)", b.seal)
        b.unpack = timed(phases, "  finish: unpack (flags.tolist, grads as views)", b.unpack)
    launch = red._launch_ready

    def launch_ready():
        t = time.perf_counter()
        launch()
        phases["  launch (seal + all_reduce call), in hooks" if red.armed else "  finish: launch last buckets"] += (
            time.perf_counter() - t)

    red._launch_ready = launch_ready
    # The hooks hold the bound method they were registered with: register the timed one instead.
    red.remove()
    on_grad = timed(phases, "  hooks: total (Python hook + copy + launch)", red._on_grad)
    red._hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in red.params]
    red.finish = timed(phases, "finish (launch rest, wait, unpack)", red.finish)
    sgd._apply_update = timed(phases, "apply update (NaN check + step + bookkeeping)", sgd._apply_update)
    sgd.optimizer.step = timed(phases, "  optimizer step", sgd.optimizer.step)
    troupe.reliability.nonfinite.all_finite = timed(phases, "  NaN/Inf check (all_finite)", troupe.reliability.nonfinite.all_finite)

    def step(x, y):
        t = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        sgd(loss)
        phases["forward + loss"] += t1 - t
        phases["backward_and_update (total)"] += time.perf_counter() - t1

    return step, phases, len(red.buckets)


def instrument_ddp(args):
    model = DDP(build_model(args), bucket_cap_mb=args.ddp_bucket_mb)
    opt = make_sgd(model)
    phases: dict[str, float] = defaultdict(float)

    def step(x, y):
        t = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        phases["forward + loss"] += time.perf_counter() - t
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        phases["backward (incl. hooks, all-reduce wait)"] += time.perf_counter() - t
        t = time.perf_counter()
        opt.step()
        phases["optimizer step"] += time.perf_counter() - t

    return step, phases


def collect(phases: dict[str, float], per_step: dict[str, list[float]]) -> None:
    for k, v in phases.items():
        per_step[k].append(v)
    phases.clear()


def main() -> None:
    args = parse_args(sys.argv[1:])
    torch.set_num_threads(args.threads)
    info = troupe.init()
    batches = make_batches(args, info.global_rank, info.world_size)
    t_step, t_phases, nb = instrument_troupe(args, args.bucket_size)
    d_step, d_phases = instrument_ddp(args)
    runs = {"troupe": (t_step, t_phases), "DDP": (d_step, d_phases)}
    per_step = {name: defaultdict(list) for name in runs}
    for x, y in batches[: args.warmup]:
        for step, phases in runs.values():
            step(x, y)
            phases.clear()
    dist.barrier()
    for i, (x, y) in enumerate(batches[args.warmup :]):
        names = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for name in names:
            step, phases = runs[name]
            t = time.perf_counter()
            step(x, y)
            phases["STEP (wall)"] = time.perf_counter() - t
            collect(phases, per_step[name])

    # The bare costs: one all-reduce of the whole gradient, one copy of it.
    numel = sum(p.numel() for p in build_model(args).parameters())
    buf, src = torch.zeros(numel), torch.randn(numel)
    bare = defaultdict(list)
    for _ in range(args.steps):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(buf)
        bare[f"all_reduce of {numel} floats"].append(time.perf_counter() - t)
        t = time.perf_counter()
        buf.copy_(src)
        bare[f"copy of {numel} floats"].append(time.perf_counter() - t)

    rows = []
    for name, table in [*per_step.items(), ("bare", bare)]:
        for k in table:
            vals = torch.tensor(table[k], dtype=torch.float64)
            dist.all_reduce(vals, dist.ReduceOp.MAX)
            rows.append((name, k, statistics.median(vals.tolist()) * 1e3, statistics.mean(vals.tolist()) * 1e3))
    if info.global_rank == 0:
        print(f"# {args.model}, batch {args.batch_size}/rank, troupe bucket_size {args.bucket_size} ({nb} buckets), "
              f"{args.steps} steps interleaved, ms per step (slowest rank)")
        print("| strategy | phase | median ms | mean ms |\n|---|---|---|---|")
        for name, k, med, mean in rows:
            print(f"| {name} | {k} | {med:.3f} | {mean:.3f} |")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see ddp_vs_troupe.py: avoid Gloo's worker thread racing interpreter finalization


if __name__ == "__main__":
    main()
