"""Collective overhead: troupe's bucketed all-reduce vs one flat dist.all_reduce, and an alpha-beta fit.

    troupe run -n 2 --threads 1 benchmarks/collectives.py --reps 7 --json docs/collectives.json

For each total size S (4 KiB .. 64 MiB of fp32) the gradient is 8 tensors of S/8:
  flat   - `dist.all_reduce` of one tensor of S bytes (the floor: no copies, one call);
  troupe - the DistOpt path after backward: tensors copied into buckets (default bucket
           size), each bucket all-reduced asynchronously, averaged, handed back.
A and B alternate inside one process group; each repetition times `--iters` calls after a
barrier; the table gives the median (and min-max) over repetitions, the ratio troupe/flat,
and bus bandwidth S/t * 2(n-1)/n. Then t = alpha + S * beta is fitted to the flat times
(least squares) and its predictions are printed next to the measurements.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import troupe
from troupe.sync.bucket import DEFAULT_BUCKET_SIZE, Bucket, plan_buckets
from troupe.runtime.comm import Communicator
from troupe.sync.reducer import mean_all_reduce

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def troupe_reduce(comm: Communicator, buckets: list[Bucket], grads: list[torch.Tensor]) -> None:
    """What GradReducer does once backward has produced every gradient."""
    reduce = mean_all_reduce(comm)
    handles = []
    for b in buckets:
        b.reset()
        for p in b.params:
            b.add_grad(p, grads[id(p)], reduce.prescale)
        b.seal()
        handles.append(reduce(b))
    for h in handles:
        h.wait()
    for b in buckets:
        b.unpack(comm.world_size)


def timed(fn, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def fit_alpha_beta(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Least-squares alpha (s) and beta (s/byte) for t = alpha + beta * bytes."""
    beta, alpha = np.polyfit(np.array(sizes, dtype=float), np.array(times), 1)
    return float(alpha), float(beta)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--iters", type=int, default=0, help="calls per repetition (default: by size)")
    p.add_argument("--sizes", type=int, nargs="*", default=SIZES, help="total bytes")
    p.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE, help="elements")
    p.add_argument("--json", default=None, help="also write the results here (rank 0)")
    args = p.parse_args()
    torch.set_num_threads(1)
    info = troupe.init()
    comm = troupe.runtime.comm.default()
    n = comm.world_size
    results = []
    for size in args.sizes:
        numel = size // 4
        params = [torch.nn.Parameter(torch.zeros(numel // 8)) for _ in range(8)]
        grads = {id(p): torch.randn(p.numel()) for p in params}
        buckets = [Bucket(i, [params[j] for j in m]) for i, m in enumerate(plan_buckets(params, args.bucket_size))]
        flat = torch.randn(numel)
        iters = args.iters or max(3, min(200, int(2e8 / max(size, 1) ** 1.0 // 10)))
        a, b = [], []
        for _ in range(args.reps):
            a.append(timed(lambda: dist.all_reduce(flat), iters))
            b.append(timed(lambda: troupe_reduce(comm, buckets, grads), iters))
        ta, tb = statistics.median(a), statistics.median(b)
        results.append({"bytes": size, "flat_s": ta, "troupe_s": tb, "ratio": tb / ta, "flat_range": [min(a), max(a)],
                        "troupe_range": [min(b), max(b)], "buckets": len(buckets), "iters": iters})
    if info.global_rank != 0:
        return
    alpha, beta = fit_alpha_beta([r["bytes"] for r in results], [r["flat_s"] for r in results])
    print(f"{n} ranks, {info.backend}, bucket_size {args.bucket_size} elements, median of {args.reps} reps\n")
    print("| size | flat all_reduce | troupe buckets | troupe / flat | bus bandwidth (troupe) | alpha-beta predicts |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        size = r["bytes"]
        bus = size / r["troupe_s"] * 2 * (n - 1) / n / 1e9
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"| {label} | {r['flat_s'] * 1e3:.3f} ms ({r['flat_range'][0] * 1e3:.3f}-{r['flat_range'][1] * 1e3:.3f}) "
              f"| {r['troupe_s'] * 1e3:.3f} ms ({r['troupe_range'][0] * 1e3:.3f}-{r['troupe_range'][1] * 1e3:.3f}) "
              f"| {r['ratio']:.2f} | {bus:.2f} GB/s | {(alpha + beta * size) * 1e3:.3f} ms |")
    print(f"\nalpha = {alpha * 1e6:.1f} us per all-reduce, beta = {beta * 1e9:.3f} ns/byte "
          f"({1 / beta / 1e9:.2f} GB/s algorithm bandwidth)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": n, "alpha_s": alpha, "beta_s_per_byte": beta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
