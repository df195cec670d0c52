"""The job `troupe bench run throughput` times on every rank: the MNIST CNN under DistOpt.

    troupe run -n 2 --threads 1 benchmarks/throughput_job.py --steps 30 --warmup 5 --batch 64

Synthetic 28x28 images, batch `--batch` per worker, one thread; `--steps` measured steps
after `--warmup`. Rank 0 prints one JSON line: world size, step time, samples/s and the
bytes per step from the Communicator's counters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    import troupe

    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_cnn import CNN

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CNN()
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    model.set_optimizer(sgd)
    x, y = troupe.data.synthetic(args.batch * 4, seed=sgd.global_rank)
    comm = sgd.communicator
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            comm.barrier()
            start, sent = time.perf_counter(), comm.bytes_sent()
        i = step % 4
        sgd(F.cross_entropy(model(x[i * args.batch : (i + 1) * args.batch]), y[i * args.batch : (i + 1) * args.batch]))
    comm.barrier()
    elapsed = time.perf_counter() - start
    if sgd.global_rank == 0:
        print(json.dumps({"world": sgd.world_size, "step_s": elapsed / args.steps,
                          "samples_per_s": args.steps * args.batch * sgd.world_size / elapsed,
                          "bytes_per_step": (comm.bytes_sent() - sent) / args.steps}), flush=True)


if __name__ == "__main__":
    main()
