"""A partitioned model under co-located servers vs the same model unpartitioned, step by step.

    troupe run --framework allreduce --nworkers-per-group 2 --nservers-per-group 2 --threads 1 \
        benchmarks/partition_colocated.py [--reps 11 --steps 20 --burnin 5]
    troupe run --framework hogwild --nworker-groups 2 --nserver-groups 2 --nworkers-per-group 2 \
        --nservers-per-group 2 --threads 1 benchmarks/partition_colocated.py --plans hybrid   # then data

Every worker builds the example's MNIST CNN twice: once whole ("data": every worker the whole
model, the group's co-located servers reduce and update all of it) and once with the
hybrid plan ("hybrid": convolutions split the batch, the linear layers their output
features; a slice's one holder updates it unreduced). Each gets its own DistOpt under the
same cluster, and they take turns step by step in the same processes
(`troupe.observe.turns.run_ab`: burn-in, then repetitions of measured steps, the order
reversed every other step; the slowest rank's time per step), so a machine shared with
other jobs slows both alike. Under Distributed Hogwild a process holds one DistOpt (its
master copies answer requests on the job's one pair of channels), so there `--plans` picks one
and the two run one after the other. Batch 64 per worker, MNIST-shaped synthetic data. Rank 0
prints one line per contestant: median step time and steps/s over the repetitions (with
their range), the group's bytes sent per step and rank, and the parameters a worker holds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH = 64
PLANS = {"data": None, "hybrid": {"conv*": 0, "linear*": 1}}
"""troupe.partition's plan per contestant (None: not partitioned)."""


def contestant(name: str, plan, batches):
    """One model and DistOpt under the job's cluster; its step trains batch i (this worker's share)."""
    import torch
    import torch.nn.functional as F

    import troupe
    from troupe.observe.turns import Contestant

    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_cnn import CNN

    torch.manual_seed(0)
    model = CNN()
    if plan is not None:
        troupe.partition(model, plan)
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    group = sgd.strategy.group  # the worker group's communicator: its reduction, all-gather and the partition's exchanges

    def step(i: int) -> dict[str, float]:
        x, y = batches[i % len(batches)]
        before = group.bytes_sent()
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sgd.step()
        return {"wire_bytes": float(group.bytes_sent() - before)}

    held = sum(p.numel() for p in model.parameters())
    return Contestant(name, step, {"param_elements": held}), sgd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--burnin", type=int, default=5)
    p.add_argument("--plans", nargs="+", choices=sorted(PLANS), default=sorted(PLANS))
    args = p.parse_args()

    import troupe
    from troupe.observe.turns import Schedule, run_ab
    from troupe.cluster.configuration.sources import from_env

    world = troupe.init()
    cluster = from_env()
    if cluster is None or cluster.server_worker_separate:
        raise SystemExit("run it under a cluster with co-located servers: troupe run --framework allreduce ...")
    if cluster.nworker_groups > 1 and len(args.plans) > 1:
        raise SystemExit("Distributed Hogwild: one DistOpt per process, give --plans data or --plans hybrid")
    x, y = troupe.data.synthetic(BATCH * 8, seed=world.rank)
    batches = [(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]) for i in range(8)]
    made = [contestant(name, PLANS[name], batches) for name in args.plans]
    contestants = [c for c, _ in made]
    measured = run_ab(contestants, Schedule(reps=args.reps, steps=args.steps, burnin=args.burnin), world.comm)
    if world.rank == 0:
        print(f"{made[0][1]}: {world.world_size} workers, batch {BATCH} per worker, "
              f"{args.reps} x {args.steps} steps after {args.burnin}", flush=True)
        for k, c in enumerate(contestants):
            times = [m.value for m in measured if m.contestant == k and m.metric == "step_time"]
            wire = [m.value for m in measured if m.contestant == k and m.metric == "wire_bytes"]
            t = statistics.median(times)
            print(f"{c.name:7s} step {t * 1e3:6.1f} ms ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}), "
                  f"{1 / t:5.1f} steps/s, {statistics.median(wire) / 1e6:.3f} MB sent per step and rank, "
                  f"{c.params['param_elements']} parameters held", flush=True)
    for _, sgd in made:
        sgd.close()


if __name__ == "__main__":
    main()
