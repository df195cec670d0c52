"""Checkpoints of sharded jobs: bytes each rank writes, save time on k ranks, load time on k/2 ranks.

    python benchmarks/shard_checkpoint.py -n 4 --layers 8 --dim 1024

An MLP of `layers` x Linear(dim, dim) with AdamW, one step, then troupe.checkpoint.save in each
regime: ``plain`` (DistOpt), ``optimizer`` / ``gradients`` (``DistOpt(shard=...)``), ``shard``
(``troupe.shard(model)``). Times are rank 0's wall time of the collective call (median of
`reps`); the largest and smallest bytes one rank wrote (its ``__r_*.distcp``); then a world of
n/2 ranks loads each checkpoint into the same regime (a reshard).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

REGIMES = ("plain", "optimizer", "gradients", "shard")


def _job(regime: str, layers: int, dim: int):
    import troupe

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    if regime == "shard":
        model = troupe.shard(model)
    shard = regime if regime in ("optimizer", "gradients") else None
    return model, troupe.DistOpt(torch.optim.AdamW(model.parameters(), lr=1e-3), shard=shard)


def _save(rank, world_size, directory, layers, dim, reps):
    from troupe.reliability import checkpoint

    torch.set_num_threads(1)
    out = {}
    for regime in REGIMES:
        model, opt = _job(regime, layers, dim)
        model(torch.randn(4, dim)).square().mean().backward()
        opt.step()
        times = []
        for rep in range(reps):
            start = time.perf_counter()
            checkpoint.save(Path(directory) / regime, rep, model, opt, keep=1)
            times.append(time.perf_counter() - start)
        step = sorted((Path(directory) / regime).glob("step-*"))[-1]
        written = [sum(f.stat().st_size for f in step.glob(f"__{r}_*.distcp")) for r in range(world_size)]
        out[regime] = (statistics.median(times), max(written), min(written))
    return out


def _load(rank, world_size, directory, layers, dim, reps):
    from troupe.reliability import checkpoint

    torch.set_num_threads(1)
    out = {}
    for regime in REGIMES:
        model, opt = _job(regime, layers, dim)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            checkpoint.load(checkpoint.latest(Path(directory) / regime), model, opt)
            times.append(time.perf_counter() - start)
        out[regime] = statistics.median(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from troupe.runtime.spawn import run_ranks

    env = {"TROUPE_JOIN_TIMEOUT": "60", "TROUPE_TIMEOUT": "300"}
    with tempfile.TemporaryDirectory() as d:
        saved = run_ranks(_save, a.n, d, a.layers, a.dim, a.reps, timeout=1200, env=env)[0]
        loaded = run_ranks(_load, a.n // 2, d, a.layers, a.dim, a.reps, timeout=1200, env=env)[0]
    params = a.layers * (a.dim * a.dim + a.dim)
    print(f"{a.layers} x Linear({a.dim}, {a.dim}): {params / 1e6:.1f} M parameters, AdamW; save on {a.n} ranks, "
          f"load on {a.n // 2}")
    print("| regime | save (s) | load (s) | MiB written by one rank (most / least) |")
    print("|---|---|---|---|")
    for regime in REGIMES:
        t, most, least = saved[regime]
        print(f"| {regime} | {t:.2f} | {loaded[regime]:.2f} | {most / 2**20:.0f} / {least / 2**20:.0f} |")


if __name__ == "__main__":
    main()
