"""The job `troupe bench faults` trains on each simulated host while it injects network faults.

    troupe run --nnodes 2 --node-rank I --master 10.78.0.1:PORT --token T -n 1 faultjob.py --steps 60

A teacher-labelled synthetic task (deterministic: the same seed gives the same bits on any
number of runs), an MLP, SGD with momentum under DistOpt (or a parameter-server cluster from
``troupe run --framework``). Every step prints ``STEP <step> <wall time>``; the end prints
``DONE rank <r> steps <n> acc <held-out accuracy> digest <sha256 of the parameters>``, which the
harness compares with the fault-free run. With TROUPE_CHECKPOINT_DIR it checkpoints every
``--checkpoint-every`` steps and resumes from the latest (under ``troupe run --max-restarts``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import troupe
from troupe.reliability import checkpoint

FEATURES, CLASSES, HIDDEN = 32, 10, 64


def task(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` samples labelled by a fixed random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, FEATURES, generator=g)
    return x, (x @ teacher).argmax(1)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=64, help="global batch per step, split among the workers")
    p.add_argument("--pace", type=float, default=0.2, help="seconds of simulated compute per step")
    p.add_argument("--dist-option", default="plain")
    p.add_argument("--checkpoint-every", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    rank, workers = opt.global_rank, opt.world_size
    if args.batch % workers:
        raise ValueError(f"--batch {args.batch} does not divide among {workers} workers")
    x_all, y_all = task(0, args.steps * args.batch)
    x_test, y_test = task(1, 1024)
    ckpt_dir, resume = checkpoint.from_env()
    start = 0
    if ckpt_dir is not None and resume != "no":
        found = checkpoint.latest(ckpt_dir)
        if found is not None:
            start = checkpoint.load(found, model, opt)["step"]
            print(f"RESUMED {start} {time.time():.3f}", flush=True)
    share = args.batch // workers
    for step in range(start, args.steps):
        lo = step * args.batch + rank * share
        loss = F.cross_entropy(model(x_all[lo:lo + share]), y_all[lo:lo + share])
        opt.update(loss, args.dist_option)
        print(f"STEP {step} {time.time():.3f}", flush=True)
        if ckpt_dir is not None and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            checkpoint.save(ckpt_dir, step + 1, model, opt)
        time.sleep(args.pace)
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    sys.stdout.flush()
    os.write(1, f"DONE rank {rank} steps {args.steps} acc {acc:.4f} digest {digest(model)}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
