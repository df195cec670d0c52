"""The job `troupe bench run bytes_per_step` runs for each configuration: the example's MNIST CNN.

    troupe run -n 2 --threads 1 benchmarks/bytes_per_step_job.py --option sparseTopK --spars 0.01 --worker-steps 24

Every worker trains `--worker-steps` steps with the example's `train_one_batch(x, y,
dist_option, spars)` and at exit prints its Communicators' byte counters on one
``BYTES {json}`` line (server ranks never run this script: they report on stderr).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
from pathlib import Path

from troupe.bench.suites.bytes_per_step import MARK, summary

ROOT = Path(__file__).resolve().parents[1]


def _report(role: str, world) -> None:
    """Print this process's counters (a worker's, after its steps and troupe's shutdown hooks)."""
    ops = {op: [t.payload_bytes, t.wire_bytes] for op, t in world.traffic.items()}
    line = json.dumps(summary(int(os.environ.get("RANK", 0)), role, ops))
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (MARK + line + "\n").encode())  # one write: the job's ranks share the pipe


def train(args: argparse.Namespace) -> None:
    import torch

    import troupe

    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_cnn import CNN

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CNN()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-5)  # the example's
    # A worker reports at exit, after troupe's shutdown hooks (registered later, so run earlier)
    # have sent what they send (a Hogwild sync still in flight, a PS worker's stop). Server ranks
    # never get here: troupe run starts them as `python -m troupe.cluster.bootstrap`, and they
    # report on stderr (SERVER_TRAFFIC).
    done = {"steps": False}
    atexit.register(lambda: done["steps"] and _report("worker", world))
    sgd = troupe.DistOpt(sgd)
    world = troupe.init()  # joined by DistOpt; its counters outlive troupe.shutdown()
    model.set_optimizer(sgd)
    if args.data == "mnist":
        x, y, _, _ = troupe.data.load_mnist()
        x, y = troupe.data.partition(x, y, sgd.global_rank, sgd.world_size)
    else:
        x, y = troupe.data.synthetic(args.batch * 4, seed=sgd.global_rank)
    bs = args.batch
    for step in range(args.worker_steps):
        i = step % (len(x) // bs)
        model.train_one_batch(x[i * bs : (i + 1) * bs], y[i * bs : (i + 1) * bs], args.option, args.spars)
    done["steps"] = True  # a worker that failed before its last step does not report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--option", default="plain", help="the example's --dist-option")
    p.add_argument("--spars", type=float, default=None)
    p.add_argument("--worker-steps", type=int, default=0)
    p.add_argument("--batch", type=int, default=64, help="per worker")
    p.add_argument("--data", choices=["mnist", "synthetic"], default="mnist")
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
