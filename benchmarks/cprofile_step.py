"""One contestant's step alone on 2 ranks, timed, with a cProfile of rank 0.

    python benchmarks/cprofile_step.py loop 300            # troupe's PyTorch loop: backward(); step(); zero_grad()
    python benchmarks/cprofile_step.py singa 300           # SINGA's sgd(loss)
    python benchmarks/cprofile_step.py ddp 300 --no-profile

The example's MNIST CNN on one fixed synthetic batch of 64 per rank, SGD with momentum, 2 ranks x
1 thread (Gloo), 20 warm-up steps, then `steps` timed ones; prints each rank's wall and CPU ms per
step and rank 0's 35 costliest functions by own time. Unlike `troupe bench run ddp` (contestants in
turns in the same processes) each contestant has the processes to itself: run them one after
another, alternating, to compare.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rank_main(rank: int, world_size: int, kind: str, steps: int, profile: bool) -> tuple[float, float, str]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    import troupe
    from troupe.bench import workloads

    model = workloads.get("cnn").model(0)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
    troupe.init()
    if kind == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

        def step() -> None:
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    else:
        sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        sgd.sync_parameters(model)

        def step() -> None:
            loss = F.cross_entropy(model(x), y)
            if kind == "singa":
                sgd(loss)
                return
            loss.backward()
            sgd.step()
            sgd.zero_grad()

    for _ in range(20):
        step()
    profiler = cProfile.Profile() if profile and rank == 0 else None
    wall, cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        step()
    if profiler is not None:
        profiler.disable()
    wall, cpu = (time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3
    text = ""
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(35)
        text = out.getvalue()
    return wall, cpu, text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["loop", "singa", "ddp"])
    p.add_argument("steps", type=int, nargs="?", default=300)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from troupe.runtime.spawn import run_ranks

    results = run_ranks(rank_main, 2, args.kind, args.steps, args.profile, timeout=900,
                        env={"TROUPE_JOIN_TIMEOUT": "60"}, context=mp.get_context("spawn"))
    for rank, (wall, cpu, _) in enumerate(results):
        print(f"rank {rank}: {args.kind} {wall:.2f} ms a step, CPU {cpu:.2f} ms")
    print(results[0][2])


if __name__ == "__main__":
    main()
