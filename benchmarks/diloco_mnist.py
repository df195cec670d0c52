"""DiLoCo beside plain all-reduce and Distributed Hogwild on the example's MNIST CNN: accuracy after the
same epochs, and the bytes the whole job sent per step.

    python benchmarks/diloco_mnist.py --epochs 2 --out benchmarks/results/diloco_mnist.jsonl

Every contestant is ``troupe run -n 4 --threads 1 <its flags> benchmarks/diloco_mnist.py job ...``,
which trains examples/mnist_cnn.py's model with its own `train_mnist_cnn` (its SGD, lr 0.05,
momentum 0.9, batch 64 per worker, real MNIST, every worker its share) and prints, on every worker
at the end, the bytes all of its Communicators counted (wire bytes: what the textbook algorithm
sends; `troupe.init().traffic`). Bytes per step = the job's wire bytes (every worker's, added) /
the steps each worker took; the start-up broadcast and the per-epoch metric reductions are in it
(a few MB, once). The worker groups are 4 x 1 for Hogwild and DiLoCo, so every byte they count
crosses between groups. One run per contestant (the runs are seeded; the wall time is one
sample on a shared 2-core machine: noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "DILOCO_BENCH "

CONTESTANTS: dict[str, list[str]] = {
    "plain": [],
    "hogwild (sync_freq 10)": ["--framework", "hogwild"],
    "diloco H=20": ["--framework", "diloco", "--nworker-groups", "4", "--sync-freq", "20"],
    "diloco H=50": ["--framework", "diloco", "--nworker-groups", "4", "--sync-freq", "50"],
    "diloco H=50 bf16": ["--framework", "diloco", "--nworker-groups", "4", "--sync-freq", "50",
                         "--pseudo-grad-dtype", "bf16"],
    "diloco H=50 int8": ["--framework", "diloco", "--nworker-groups", "4", "--sync-freq", "50",
                         "--pseudo-grad-dtype", "int8"],
    "diloco H=50 fp8": ["--framework", "diloco", "--nworker-groups", "4", "--sync-freq", "50",
                        "--pseudo-grad-dtype", "fp8"],
    "diloco H=50 int4": ["--framework", "diloco", "--nworker-groups", "4", "--sync-freq", "50",
                         "--pseudo-grad-dtype", "int4"],
    "streaming H=50 K=4 int4": ["--framework", "diloco", "--nworker-groups", "4", "--sync-freq", "50",
                                "--fragments", "4", "--pseudo-grad-dtype", "int4"],
    "streaming H=50 K=4 tau=5 int4": ["--framework", "diloco", "--nworker-groups", "4", "--sync-freq", "50",
                                      "--fragments", "4", "--delay", "5", "--pseudo-grad-dtype", "int4"],
}
"""troupe run flags of each contestant (4 processes each)."""


def job(argv: list[str]) -> None:
    """One worker of a contestant's job: the example's training, then this process's counters."""
    sys.path.insert(0, str(ROOT / "examples"))
    import mnist_cnn

    import troupe

    args = mnist_cnn.parse_args(argv)
    _, history = mnist_cnn.train_mnist_cnn(args)
    traffic = troupe.init().traffic
    wire = sum(t.wire_bytes for op, t in traffic.items())
    line = json.dumps({"rank": int(os.environ.get("RANK", 0)), "wire": wire, "history": history})
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (MARK + line + "\n").encode())  # one write: the ranks share the pipe


def run(name: str, flags: list[str], epochs: int, max_steps: int | None) -> dict:
    """Run one contestant; its accuracy per epoch, bytes per step and wall time."""
    extra = ["--max-steps", str(max_steps)] if max_steps else []
    cmd = ["troupe", "run", "-n", "4", "--threads", "1", *flags, str(Path(__file__)), "job", "--epochs", str(epochs),
           "--quiet", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{name}: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    reports = [json.loads(m) for m in re.findall(rf"^{MARK}(.*)$", done.stdout, re.M)]
    if len(reports) != 4:
        raise RuntimeError(f"{name}: {len(reports)} worker reports, expected 4:\n{done.stdout[-2000:]}")
    steps = int(re.search(r"(\d+) training samples per rank, batch (\d+)", done.stdout).group(1)) // 64
    steps = min(steps, max_steps or steps) * epochs
    history = reports[0]["history"]
    return {"contestant": name, "flags": " ".join(flags), "epochs": epochs, "steps_per_worker": steps,
            "eval_acc": [round(h["eval_acc"], 4) for h in history],
            "bytes_per_step": sum(r["wire"] for r in reports) / steps, "wall_s": round(wall, 1)}


def table(rows: list[dict]) -> str:
    plain = next((r["bytes_per_step"] for r in rows if r["contestant"] == "plain"), None)
    lines = ["| contestant | eval accuracy per epoch | bytes per step (job) | vs plain | wall s (1 run) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        ratio = f"{r['bytes_per_step'] / plain:.4f}" if plain else "-"
        lines.append(f"| {r['contestant']} | {' / '.join(f'{a:.4f}' for a in r['eval_acc'])} | "
                     f"{r['bytes_per_step']:,.0f} | {ratio} | {r['wall_s']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        return job(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=None, help="steps per epoch (a quick look)")
    p.add_argument("--only", nargs="+", default=None, help="these contestants only")
    p.add_argument("--out", default=None, help="append every row as a JSON line")
    args = p.parse_args(argv)
    rows = []
    for name, flags in CONTESTANTS.items():
        if args.only and name not in args.only:
            continue
        rows.append(run(name, flags, args.epochs, args.max_steps))
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
