"""troupe's DistOpt step against DDP's on one CUDA GPU, NCCL, a world of one rank.

    python benchmarks/gpu_step.py [--steps 31] [--batch 128] [--workload resnet18|cnn]

With one rank the all-reduce moves nothing over a link, so what differs is each side's own work
per step: hooks, bucket copies, launches, Python. Both train their own copy of the same model
(same initial weights) on the same batches, taking turns step by step; each step ends with
``torch.cuda.synchronize()``. Prints the median step of each and their ratio, and the largest
parameter difference after the run (both take the same steps, so it stays at rounding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def build(workload: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if workload == "resnet18":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from resnet import resnet18

        return resnet18(num_classes=10)
    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_cnn import CNN

    return CNN()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=31)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--workload", choices=("resnet18", "cnn"), default="resnet18")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step: no CUDA device")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    import troupe
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", 0)
    shape = (3, 32, 32) if args.workload == "resnet18" else (1, 28, 28)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, *shape, generator=gen).to(dev),
                torch.randint(0, 10, (args.batch,), generator=gen).to(dev)) for _ in range(8)]

    ddp_model = DDP(build(args.workload, 0).to(dev), bucket_cap_mb=25, broadcast_buffers=False)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    t_model = build(args.workload, 0).to(dev)
    t_opt = troupe.DistOpt(torch.optim.SGD(t_model.parameters(), lr=0.01, momentum=0.9))
    t_opt.sync_parameters(t_model)

    def ddp_step(x, y):
        loss = F.cross_entropy(ddp_model(x), y)
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()

    def troupe_step(x, y):  # the PyTorch loop on a DistOpt
        loss = F.cross_entropy(t_model(x), y)
        loss.backward()
        t_opt.synchronize()
        t_opt.step()
        t_opt.zero_grad()

    def troupe_singa(x, y):  # SINGA's sgd(loss)
        t_opt(F.cross_entropy(t_model(x), y))

    contestants = {"DDP": ddp_step, "troupe (PyTorch loop)": troupe_step, "troupe sgd(loss)": troupe_singa}
    times: dict[str, list[float]] = {k: [] for k in contestants}
    order = list(contestants)
    for i in range(args.warmup + args.steps):
        x, y = batches[i % len(batches)]
        for name in order if i % 2 == 0 else reversed(order):  # alternate who goes first
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            contestants[name](x, y)
            torch.cuda.synchronize()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["DDP"])
    print(f"{args.workload}, batch {args.batch}, {torch.cuda.get_device_name(0)}, NCCL world 1, "
          f"median of {args.steps} steps each, alternating")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:24s} {m * 1e3:8.3f} ms   {m / base:5.3f}x DDP")
    # troupe's model took two steps per DDP step (two troupe contestants): compare after one more
    # identical run instead, from fresh copies, to check the two compute the same thing.
    a, b = build(args.workload, 0).to(dev), build(args.workload, 0).to(dev)
    oa = torch.optim.SGD(a.parameters(), lr=0.01, momentum=0.9)
    ob = troupe.DistOpt(torch.optim.SGD(b.parameters(), lr=0.01, momentum=0.9))
    for i in range(5):
        x, y = batches[i]
        F.cross_entropy(a(x), y).backward()
        oa.step()
        oa.zero_grad()
        ob(F.cross_entropy(b(x), y))
    diff = max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))
    print(f"  after 5 steps: largest |param(torch SGD) - param(troupe)| = {diff:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
