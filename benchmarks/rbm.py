"""RBM pre-training + autoencoder fine-tuning (examples/rbm_mnist.py) vs PCA-30: test reconstruction error, wall time.

    python benchmarks/rbm.py                                   # 1, 2 and 4 processes, defaults below
    python benchmarks/rbm.py --procs 2 --pretrain-epochs 2 --finetune-epochs 6 --out benchmarks/results/rbm.jsonl

PCA-30 is computed here on the same data (MNIST's 60,000 training images centred by their
mean, the top 30 eigenvectors of their covariance; the test images projected and
reconstructed), giving the baseline of Hinton & Salakhutdinov's Table (13.87 there). Each
process count runs the example under ``troupe run -n N`` with the global batch held at
100 (``--batch-size 100/N`` per rank), so every run is the same algorithm on the same
data and only the wall time should differ. The error is the example's last line: the sum
over the 784 pixels (in [0, 1]) of the squared error, per test image, over all 10,000.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PAPER = {"autoencoder": 3.00, "pca30": 13.87}  # Hinton & Salakhutdinov, Science 2006, MNIST test set


def pca_error(components: int = 30) -> float:
    """Squared error per test image of PCA with `components` components fitted on the training images."""
    import troupe

    train_x, _, test_x, _ = troupe.data.load_mnist()
    train_x, test_x = train_x.flatten(1).double(), test_x.flatten(1).double()
    mean = train_x.mean(0)
    centred = train_x - mean
    _, vectors = torch.linalg.eigh(centred.T @ centred)  # ascending eigenvalues
    basis = vectors[:, -components:]
    recon = (test_x - mean) @ basis @ basis.T + mean
    return float((test_x - recon).square().sum(1).mean())


def run_example(procs: int, args: argparse.Namespace) -> dict:
    flags = ["--pretrain-epochs", str(args.pretrain_epochs), "--finetune-epochs", str(args.finetune_epochs),
             "--batch-size", str(100 // procs), "--finetune-lr", str(args.finetune_lr),
             "--lr-gaussian", str(args.lr_gaussian), "--threads", "1", "--quiet", *args.extra]
    from troupe.bench.jobs import run_job

    start = time.perf_counter()
    done = run_job(["examples/rbm_mnist.py", *flags], procs, threads=None, env={"OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    out = done.check().stdout
    error = float(re.search(r"^test reconstruction error = ([\d.]+) per image$", out, re.M).group(1))
    pre = float(re.search(r"^pre-training ([\d.]+)s, total ([\d.]+)s$", out, re.M).group(1))
    before = float(re.search(r"before fine-tuning: test reconstruction error = ([\d.]+)", out).group(1))
    return {"procs": procs, "test_error": error, "before_finetune": before, "pretrain_s": pre, "wall_s": wall,
            "command": "troupe run -n {} examples/rbm_mnist.py {}".format(procs, " ".join(flags)), "log": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--pretrain-epochs", type=int, default=2)
    p.add_argument("--finetune-epochs", type=int, default=6)
    p.add_argument("--finetune-lr", type=float, default=0.01)
    p.add_argument("--lr-gaussian", type=float, default=0.005)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more flags for the example")
    p.add_argument("--out", default=None, help="append one JSON line per run here")
    args = p.parse_args(argv)

    pca = pca_error()
    print(f"PCA-30 test reconstruction error = {pca:.3f} per image (paper: {PAPER['pca30']})", flush=True)
    rows = [{"procs": "PCA-30", "test_error": pca}]
    for procs in args.procs:
        row = run_example(procs, args)
        print(f"{procs} process(es): test error {row['test_error']:.3f} (before fine-tuning "
              f"{row['before_finetune']:.3f}), pre-training {row['pretrain_s']:.0f}s, wall {row['wall_s']:.0f}s",
              flush=True)
        rows.append(row)
        if args.out:
            with open(args.out, "a") as f:
                record = {k: v for k, v in row.items() if k != "log"}
                f.write(json.dumps({**record, "pca30": pca, "host": platform.node(), "cpus": os.cpu_count()}) + "\n")
    print("\n| run | test squared error per image | vs PCA-30 | pre-training s | wall s |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        if row["procs"] == "PCA-30":
            print(f"| PCA-30 | {pca:.2f} | 1.00 | | |")
        else:
            print(f"| {row['procs']} process(es) | {row['test_error']:.2f} | {row['test_error'] / pca:.2f} | "
                  f"{row['pretrain_s']:.0f} | {row['wall_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
