"""Step time while troupe.checkpoint writes an asynchronous save, against steps without a save and a blocking save.

    python benchmarks/checkpoint_async.py --ranks 2 --reps 11            # the MNIST CNN
    python benchmarks/checkpoint_async.py --ranks 2 --reps 11 --model mlp

Data-parallel training (DistOpt plain, SGD momentum, synthetic batches of 32 per rank) of
the CNN of examples/mnist_cnn.py (431 k parameters) or ``--model mlp`` (4 x Linear(2048,
2048), 16.8 M), one torch thread per rank. In the same processes, each repetition runs a
fixed schedule (the same on every rank): 6 plain steps; a step that starts with
``save(..., async_save=True)`` followed by 15 steps, each noting whether the save is still
being written; ``wait()``; a step that starts with a blocking ``save``. "steps the writing
spans" counts the step with the call. Times are rank 0's
wall time per step (each ends in the gradient all-reduce, so the ranks keep in step); the
first repetition is a warm-up. Prints the medians (the table in docs/reliability.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PLAIN, AFTER = 6, 15


def child(reps: int, directory: str, which: str) -> None:
    import torch.nn.functional as F
    from torch import nn

    import troupe
    from troupe.reliability import checkpoint

    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_cnn import CNN

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CNN() if which == "cnn" else nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    x = torch.randn(32, 1, 28, 28) if which == "cnn" else torch.randn(32, 2048)
    y = torch.randint(0, 10, (32,))

    def step(save: bool = False, async_save: bool = False) -> float:
        start = time.perf_counter()
        if save:
            checkpoint.save(directory, step.n, model, sgd, {"step": step.n}, async_save=async_save)
            times["save call, async" if async_save else "save call, blocking"].append(time.perf_counter() - start)
        logits = model(x)
        sgd(F.cross_entropy(logits if which == "cnn" else logits[:, :10], y))
        step.n += 1
        return time.perf_counter() - start

    step.n = 0
    times: dict[str, list[float]] = {"plain": [], "async call": [], "during": [], "after": [], "blocking": [],
                                     "steps to write": [], "save call, async": [], "save call, blocking": []}
    for rep in range(reps + 1):
        record = rep > 0  # the first repetition warms up
        plain = [step() for _ in range(PLAIN)]
        call = step(save=True, async_save=True)
        following = []
        for _ in range(AFTER):
            busy = checkpoint.in_flight() is not None  # noted before the step: the save was still being written
            following.append((busy, step()))
        checkpoint.wait()
        blocking = step(save=True)
        if not record:
            times["save call, async"].clear()
            times["save call, blocking"].clear()
        else:
            times["plain"] += plain
            times["async call"].append(call)
            times["during"] += [t for busy, t in following if busy]
            times["after"] += [t for busy, t in following if not busy]
            times["blocking"].append(blocking)
            times["steps to write"].append(1 + sum(busy for busy, _ in following))
    if sgd.communicator.rank == 0:
        print("RESULT " + json.dumps({"world_size": sgd.communicator.world_size, "times": times}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn",
                   help="cnn: examples/mnist_cnn.py's CNN (431 k parameters); mlp: 4 x Linear(2048, 2048)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.reps, args.child, args.model)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"{args.model}, SGD momentum, DistOpt plain, batch 32 per rank; rank 0's step time, median over "
          f"{args.reps} repetitions\n")
    print("| ranks | step, no save | step with the async save call (the call) | steps the writing spans | "
          "step during the writing (n) | step with a blocking save (the call) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", str(n), __file__, "--reps", str(args.reps),
                   "--model", args.model, "--child", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{n} ranks failed:\n{proc.stdout}\n{proc.stderr}")
        t = json.loads(line[len("RESULT "):])["times"]
        ms = {k: statistics.median(v) * 1e3 for k, v in t.items() if v and k != "steps to write"}
        print(f"| {n} | {ms['plain']:.1f} ms | {ms['async call']:.1f} ms ({ms['save call, async']:.1f} ms) | "
              f"{statistics.median(t['steps to write']):.0f} | {ms.get('during', float('nan')):.1f} ms "
              f"({len(t['during'])}) | {ms['blocking']:.1f} ms ({ms['save call, blocking']:.1f} ms) |")


if __name__ == "__main__":
    main()
