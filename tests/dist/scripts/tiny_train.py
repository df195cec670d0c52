"""A few DistOpt steps on a tiny model; each rank saves its final parameters to OUT/rank{R}.pt.

    python tiny_train.py OUT                   # under troupe run, torchrun or mpiexec
    python tiny_train.py OUT --ticket N        # the multiprocessing + Ticket pattern, N ranks
    python tiny_train.py OUT --loop OPTION     # the PyTorch loop (no_sync accumulation, GradScaler,
                                               # clipping, StepLR) with DistOpt(dist_option=OPTION)
    python tiny_train.py OUT --loop sgd --loop fp16   # several loops, one after the other in the same
                                               # processes (sgd: SINGA's sgd(loss)), each on a model
                                               # and DistOpt of its own, saved to OUT/rank{R}-{loop}.pt
"""

import multiprocessing
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

import troupe


def torch_loop(model, opt, g, steps=5, accum=2):
    """The issue's loop: micro-batches under no_sync, synchronize, unscale, clip, scaler.step, StepLR."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        for i in range(accum):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            with nullcontext() if i == accum - 1 else opt.no_sync():
                scaler.scale(F.cross_entropy(model(x), y) / accum).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()


def train(out, ticket=None, local_rank=None, world_size=None, loops=(None,)):
    """Each loop of `loops` (None: SINGA's sgd(loss); else the PyTorch loop under that dist_option) in turn."""
    torch.set_num_threads(1)
    for k, option in enumerate(loops):
        torch.manual_seed(os.getpid() + k)  # a different init everywhere: DistOpt must broadcast rank 0's
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        joins = {"ticket": ticket, "local_rank": local_rank, "world_size": world_size} if k == 0 else {}
        opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dist_option=option or "plain",
                             spars=0.5 if option == "sparseTopK" else None, **joins)
        g = torch.Generator().manual_seed(opt.global_rank)
        if option is not None:
            torch_loop(model, opt, g)
        else:
            for _ in range(5):
                x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
                opt(F.cross_entropy(model(x), y))
        info = troupe.info()
        name = f"rank{opt.global_rank}.pt" if len(loops) == 1 else f"rank{opt.global_rank}-{option or 'sgd'}.pt"
        torch.save({"params": [p.detach() for p in model.parameters()], "world_size": opt.world_size,
                    "launcher": info.launcher}, os.path.join(out, name))


if __name__ == "__main__":
    out, rest = sys.argv[1], sys.argv[2:]
    loops = tuple(None if rest[i + 1] == "sgd" else rest[i + 1] for i, a in enumerate(rest) if a == "--loop") or (None,)
    if "--ticket" in rest:
        ticket, n = troupe.Ticket(), int(rest[rest.index("--ticket") + 1])
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=train, args=(out, ticket, r, n, loops)) for r in range(n)]
        for p in procs:
            p.start()
        sys.exit(troupe.wait_all(procs))
    train(out, loops=loops)
