"""Training time until the MNIST CNN reaches a test accuracy, for one dist_option.

Trains the example's CNN (SGD lr 0.005, momentum 0.9, batch 64 per rank) and evaluates
on the full test set every `--eval-every` steps; the clock stops during evaluation.
Rank 0 prints one JSON line: the option, the seconds and steps until `--target` was
first reached (null if never), and the final accuracy; with `--out FILE` it also appends
troupe bench records (the curve as "accuracy" records: `troupe bench plot FILE out.png`).

    troupe run -n 2 --threads 1 benchmarks/time_to_accuracy.py --dist-option sparseTopK --spars 0.01
    benchmarks/shaped_link.sh 100mbit sparseTopK --spars 0.01      # two network namespaces, tc-limited
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import troupe

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))
from mnist_cnn import CNN  # noqa: E402  (the example's model, unchanged)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dist-option", default="plain")
    p.add_argument("--spars", type=float, default=None)
    p.add_argument("--powersgd-rank", type=int, default=1, help="powerSGD: the rank r of its factors")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--eval-every", type=int, default=100, help="steps")
    p.add_argument("--target", type=float, default=0.985)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke tests)")
    p.add_argument("--out", default=None, help="append troupe bench records (JSON lines) here (rank 0)")
    p.add_argument("--name", default=None, help="the contestant's name in the records (default: the dist_option)")
    return p.parse_args(argv)


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i : i + 500]).argmax(1) == y[i : i + 500]).sum()) for i in range(0, len(x), 500))
    model.train()
    return troupe.metrics.reduce_variable(correct) / troupe.metrics.reduce_variable(len(x))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    model = CNN()
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-5),
                         powersgd_rank=args.powersgd_rank)
    model.set_optimizer(sgd)
    rank, n = sgd.global_rank, sgd.world_size
    train_x, train_y, test_x, test_y = troupe.data.load_mnist()
    x, y = troupe.data.partition(train_x, train_y, rank, n)
    tx, ty = troupe.data.partition(test_x, test_y, rank, n)
    bs = args.batch_size
    g = torch.Generator().manual_seed(rank)
    clock, step, reached, curve, acc = 0.0, 0, None, [], 0.0
    for _ in range(args.epochs):
        perm = torch.randperm(len(x), generator=g)
        for b in range(len(x) // bs):
            if args.max_steps is not None and step >= args.max_steps:
                break
            start = time.perf_counter()
            sel = perm[b * bs : (b + 1) * bs]
            model.train_one_batch(x[sel], y[sel], args.dist_option, args.spars)
            clock += time.perf_counter() - start
            step += 1
            if step % args.eval_every == 0:
                acc = evaluate(model, tx, ty)
                curve.append((step, round(clock, 2), round(acc, 4)))
                if reached is None and acc >= args.target:
                    reached = (round(clock, 2), step)
    acc = evaluate(model, tx, ty)
    if rank == 0:
        result = {
            "option": args.name or args.dist_option,
            "spars": args.spars,
            "world_size": n,
            "seconds_to_target": reached and reached[0],
            "steps_to_target": reached and reached[1],
            "train_seconds": round(clock, 2),
            "steps": step,
            "final_acc": round(acc, 4),
            "curve": curve,
        }
        print(json.dumps(result), flush=True)
        if args.out:
            save_records(args.out, result, args)


def save_records(path: str, result: dict, args: argparse.Namespace) -> None:
    """The run as troupe bench records: time and steps to the target, final accuracy, the curve."""
    from pathlib import Path

    from troupe.bench.records import Record, save, stamp

    name = args.name or args.dist_option + (f" (spars {args.spars})" if args.spars is not None else "")
    params = {"target": args.target, "lr": args.lr, "batch_size": args.batch_size, "epochs": args.epochs,
              "eval_every": args.eval_every}

    def record(metric: str, value, unit: str, **extra) -> Record:
        return Record(benchmark="time_to_accuracy", contestant=name, workload="cnn", params={**params, **extra},
                      world_size=result["world_size"], rep=0, metric=metric, value=value, unit=unit)

    out = [record("seconds_to_target", result["seconds_to_target"], "s"),
           record("steps_to_target", result["steps_to_target"], "steps"),
           record("train_seconds", result["train_seconds"], "s"), record("final_acc", result["final_acc"], "ratio")]
    out += [record("accuracy", acc, "ratio", step=step, seconds=seconds) for step, seconds, acc in result["curve"]]
    save(path, out, stamp(Path(__file__).resolve().parents[1]))


if __name__ == "__main__":
    main()
