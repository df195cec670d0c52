"""The step time of the example CNN under whatever cluster the launcher gives (forward, backward, DistOpt's step).

    troupe run --nworker-groups 1 --nservers-per-group 1 --server-worker-separate benchmarks/ps_step.py

Rank 0 prints the median over the steps after a burn-in and whether its Updates left during backward.
To compare two versions of troupe, run it alternately with PYTHONPATH=<checkout>/src for each
(docs/clusters.md, "Frames").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import troupe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from mnist_cnn import CNN  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--burn-in", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CNN()
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    opt.sync_parameters(model)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    times = []
    for n in range(args.steps):
        t = time.perf_counter()
        opt(F.cross_entropy(model(x), y))
        if n >= args.burn_in:
            times.append(time.perf_counter() - t)
    if opt.global_rank == 0:
        print(f"step median {statistics.median(times) * 1e3:.2f} ms, {len(times) / sum(times):.1f} steps/s, "
              f"sent during backward: {getattr(opt.strategy, 'overlap', None)}", flush=True)
    opt.close()


if __name__ == "__main__":
    main()
