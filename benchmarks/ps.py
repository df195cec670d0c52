"""Parameter-server frameworks vs plain all-reduce: time to accuracy, server updates/s, staleness.

    python benchmarks/ps.py                       # every framework, 4 processes each
    python benchmarks/ps.py --straggler           # worker 1 runs 2x slower
    python benchmarks/ps.py --frameworks plain,downpour --target 0.97 --steps 600

Each framework trains the same MLP on MNIST through `troupe run` (the training code,
below `worker()`, is one unchanged script; only the launch flags differ). Worker 0
evaluates every --eval-every steps; the time to accuracy is from its first step to the
first evaluation at or above --target. Servers report slice updates per second and
the staleness of the updates they applied (versions applied in between).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

FRAMEWORKS = {
    # every configuration uses 4 processes
    "plain": ["-n", "4"],
    "sandblaster": ["--nworkers-per-group", "3", "--nservers-per-group", "1", "--server-worker-separate"],
    "allreduce": ["-n", "4", "--framework", "allreduce"],
    "downpour": ["--nworker-groups", "3", "--nservers-per-group", "1", "--server-worker-separate"],
    "hogwild": ["-n", "4", "--framework", "hogwild", "--sync-freq", "5"],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--steps", type=int, default=300, help="training steps per worker")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--straggler", action="store_true", help="worker 1 sleeps as long as it computes (2x slower)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    """The training script every rank runs (servers never return from DistOpt)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import troupe

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
    opt.sync_parameters(model)
    train_x, train_y, test_x, test_y = troupe.data.load_mnist()
    x, y = troupe.data.partition(train_x, train_y, opt.global_rank, opt.world_size)
    test_x, test_y = test_x[:2000], test_y[:2000]
    g = torch.Generator().manual_seed(opt.global_rank)
    reached, acc, start = None, 0.0, time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        idx = torch.randint(0, len(x), (args.batch_size,), generator=g)
        opt(F.cross_entropy(model(x[idx]), y[idx]))
        if args.straggler and opt.global_rank == 1:
            time.sleep(time.perf_counter() - t0)
        if opt.global_rank == 0 and (step % args.eval_every == 0 or step == args.steps):
            with torch.no_grad():
                acc = (model(test_x).argmax(1) == test_y).float().mean().item()
            if reached is None and acc >= args.target:
                reached = (time.perf_counter() - start, step)
    elapsed = time.perf_counter() - start
    staleness = getattr(opt.ps, "staleness", None) or [0]
    if opt.global_rank == 0:
        print("RESULT " + json.dumps({
            "time_to_target": reached and round(reached[0], 2), "steps_to_target": reached and reached[1],
            "final_acc": round(acc, 4), "seconds": round(elapsed, 2), "steps_per_s": round(args.steps / elapsed, 1),
            "worker_staleness_mean": round(sum(staleness) / len(staleness), 2), "worker_staleness_max": max(staleness),
        }), flush=True)
    opt.close()


SERVER_LINE = re.compile(
    r"troupe server rank \d+: (\d+) slice updates in ([\d.]+)s \((\d+)/s\), staleness mean ([\d.]+) max (\d+)"
)


def run_one(name: str, args) -> dict:
    cmd = [sys.executable, "-m", "troupe.cli", "run", *FRAMEWORKS[name], __file__, "--worker",
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
           "--target", str(args.target), "--eval-every", str(args.eval_every)]
    if args.straggler:
        cmd.append("--straggler")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    found = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not found:
        raise RuntimeError(f"{name} failed (code {done.returncode}):\n{done.stderr[-2000:]}")
    row = {"framework": name, **found[0], "wall": round(wall, 1)}
    servers = [m.groups() for m in SERVER_LINE.finditer(done.stderr)]
    if servers:
        row["server_updates_per_s"] = sum(int(u) for u, *_ in servers) / max(float(s) for _, s, *_ in servers)
        row["server_staleness_mean"] = max(float(m) for *_, m, _ in servers)
        row["server_staleness_max"] = max(int(x) for *_, x in servers)
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    names = [n.strip() for n in args.frameworks.split(",") if n.strip()]
    unknown = sorted(set(names) - set(FRAMEWORKS))
    if unknown:
        raise SystemExit(f"unknown framework(s) {unknown}; choose from {sorted(FRAMEWORKS)}")
    print(f"| framework | time to {args.target:.1%} (s) | steps | final acc | worker steps/s | "
          "server slice updates/s | staleness mean/max |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        r = run_one(name, args)
        ups = f"{r['server_updates_per_s']:.0f}" if "server_updates_per_s" in r else "-"
        stale = f"{r.get('server_staleness_mean', r['worker_staleness_mean']):.2f} / " \
                f"{r.get('server_staleness_max', r['worker_staleness_max'])}"
        ttt = "not reached" if r["time_to_target"] is None else f"{r['time_to_target']:.1f}"
        print(f"| {name} | {ttt} | {r['steps_to_target'] or '-'} | {r['final_acc']:.4f} | {r['steps_per_s']} | "
              f"{ups} | {stale} |", flush=True)


if __name__ == "__main__":
    main()
