"""Training time until a model reaches a quality: the MNIST CNN's test accuracy, or the word LM's perplexity.

Two workloads (``--workload``), each evaluated every `--eval-every` steps with the clock stopped:

- ``cnn`` (default): the example's CNN (SGD lr 0.005, momentum 0.9, batch 64 per rank) through
  SINGA's ``train_one_batch``; the quality is the accuracy on the full test set (higher is better).
- ``word_lm``: examples/word_lm.py's LSTM language model with tied embeddings (Adam, cosine decay,
  gradient clipping) through the PyTorch loop, on ``--text`` or, by default, the documentation topics
  that ship with Python itself (``pydoc_data``, about 114,000 tokens: offline); the quality is the
  perplexity on the held-out end of the text (lower is better).

Rank 0 prints one JSON line: the contestant, the seconds and steps until `--target` was first
reached (null if never, or no target), the final quality and the curve; with `--out FILE` it also
appends troupe bench records (the curve as "accuracy" or "perplexity" records: `troupe bench plot
FILE out.png`).

    troupe run -n 2 --threads 1 benchmarks/time_to_accuracy.py --dist-option sparseTopK --spars 0.01
    troupe run -n 4 --threads 1 benchmarks/time_to_accuracy.py --workload word_lm --epochs 10 --target 60
    benchmarks/shaped_link.sh 100mbit sparseTopK --spars 0.01      # two network namespaces, tc-limited
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import troupe

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))
import word_lm  # noqa: E402  (the example's model and data, unchanged)
from mnist_cnn import CNN  # noqa: E402

QUALITY = {"cnn": "accuracy", "word_lm": "perplexity"}
"""The quality each workload is timed to (accuracy: higher is better; perplexity: lower)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(QUALITY), default="cnn")
    p.add_argument("--dist-option", default="plain")
    p.add_argument("--spars", type=float, default=None)
    p.add_argument("--powersgd-rank", type=int, default=1, help="powerSGD: the rank r of its factors")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=None, help="per rank (cnn: 64 images; word_lm: 16 streams)")
    p.add_argument("--lr", type=float, default=None, help="cnn: SGD's, default 0.005; word_lm: Adam's, 3e-3")
    p.add_argument("--eval-every", type=int, default=100, help="steps")
    p.add_argument("--target", type=float, default=None,
                   help="the quality to reach (default: accuracy 0.985 for cnn; none for word_lm)")
    p.add_argument("--text", default=None, help="word_lm: a UTF-8 text file (default: Python's documentation topics)")
    p.add_argument("--dim", type=int, default=128, help="word_lm: embedding and LSTM width")
    p.add_argument("--period", type=int, default=None,
                   help="steps between the groups' exchanges (Hogwild, DiLoCo): the time of every period-th step "
                        "is reported apart (exchange_seconds)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke tests)")
    p.add_argument("--out", default=None, help="append troupe bench records (JSON lines) here (rank 0)")
    p.add_argument("--name", default=None, help="the contestant's name in the records (default: the dist_option)")
    p.add_argument("--clip", type=float, default=0.5, help="word_lm: clip_grad_norm_ to this (0: no clipping)")
    args = p.parse_args(argv)
    cnn = args.workload == "cnn"
    args.lr = args.lr if args.lr is not None else 0.005 if cnn else 3e-3
    args.batch_size = args.batch_size or (64 if cnn else 16)
    if args.target is None and cnn:
        args.target = 0.985
    return args


@dataclass
class Run:
    """One workload, built on this rank: its steps and how its quality is measured."""

    step: Callable[[int], None]
    """Train on this epoch's batch number b (one optimizer step)."""
    batches: int
    """Optimizer steps per epoch."""
    start_epoch: Callable[[], None]
    """Draw the epoch's batch order (cnn) or restart the LSTM state (word_lm)."""
    quality: Callable[[], float]
    """The quality over every rank's share of the held-out data (the same number on every rank)."""
    world_size: int
    rank: int


def cnn(args: argparse.Namespace) -> Run:
    """The example's CNN with SINGA's train_one_batch; quality = test accuracy."""
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
    order = torch.arange(len(x))

    def start_epoch() -> None:
        nonlocal order
        order = torch.randperm(len(x), generator=g)

    def step(b: int) -> None:
        sel = order[b * bs : (b + 1) * bs]
        model.train_one_batch(x[sel], y[sel], args.dist_option, args.spars)

    def quality() -> float:
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(tx[i : i + 500]).argmax(1) == ty[i : i + 500]).sum()) for i in range(0, len(tx), 500))
        model.train()
        return troupe.metrics.reduce_variable(correct) / troupe.metrics.reduce_variable(len(tx))

    return Run(step, len(x) // bs, start_epoch, quality, n, rank)


def python_docs() -> str:
    """The documentation topics that ship with Python (pydoc_data): English prose with code, offline."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


def word_language_model(args: argparse.Namespace) -> Run:
    """examples/word_lm.py's model and data through the PyTorch loop; quality = validation perplexity."""
    torch.manual_seed(0)
    text = Path(args.text).read_text(encoding="utf-8", errors="replace") if args.text else python_docs()
    tokens = word_lm.tokenize(text)
    cut = int(len(tokens) * 0.9)
    vocab = word_lm.Vocab(tokens[:cut], 10_000)
    model = word_lm.WordLM(len(vocab), args.dim, 2, 0.2)
    sgd = troupe.DistOpt(torch.optim.Adam(model.parameters(), lr=args.lr), dist_option=args.dist_option,
                         spars=args.spars, powersgd_rank=args.powersgd_rank)
    rank, n = sgd.global_rank, sgd.world_size
    wins = word_lm.windows(word_lm.streams(vocab.encode(tokens[:cut]), rank, n, args.batch_size), 35)
    valid = word_lm.streams(vocab.encode(tokens[cut:]), rank, n, 10)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, args.epochs * len(wins))
    state = None  # the LSTM's, carried from window to window within an epoch

    def start_epoch() -> None:
        nonlocal state
        state = None

    def step(b: int) -> None:
        nonlocal state
        _, state = word_lm.train_step(model, sgd, wins[b : b + 1], state, args)
        sched.step()

    def quality() -> float:
        total, count = word_lm.evaluate(model, valid, 35)
        model.train()
        return math.exp(troupe.metrics.reduce_variable(total) / troupe.metrics.reduce_variable(count))

    return Run(step, len(wins), start_epoch, quality, n, rank)


WORKLOADS = {"cnn": cnn, "word_lm": word_language_model}


def reached(value: float, target: float | None, workload: str) -> bool:
    """Whether a quality meets the target (accuracy from below, perplexity from above)."""
    if target is None:
        return False
    return value >= target if QUALITY[workload] == "accuracy" else value <= target


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = WORKLOADS[args.workload](args)
    clock, step, when, curve = 0.0, 0, None, []
    exchange_clock = 0.0  # the time of the steps that end in an exchange (every --period-th)
    for _ in range(args.epochs):
        run.start_epoch()
        for b in range(run.batches):
            if args.max_steps is not None and step >= args.max_steps:
                break
            start = time.perf_counter()
            run.step(b)
            took = time.perf_counter() - start
            clock += took
            step += 1
            if args.period and step % args.period == 0:
                exchange_clock += took
            if step % args.eval_every == 0:
                value = run.quality()
                curve.append((step, round(clock, 2), round(value, 4)))
                if when is None and reached(value, args.target, args.workload):
                    when = (round(clock, 2), step)
    final = run.quality()
    if run.rank == 0:
        result = {
            "option": args.name or args.dist_option,
            "workload": args.workload,
            "spars": args.spars,
            "world_size": run.world_size,
            "seconds_to_target": when and when[0],
            "steps_to_target": when and when[1],
            "train_seconds": round(clock, 2),
            "steps": step,
            f"final_{'acc' if args.workload == 'cnn' else 'ppl'}": round(final, 4),
            "curve": curve,
        }
        if args.period:
            result["exchange_seconds"] = round(exchange_clock, 2)
            result["exchanges"] = step // args.period
        print(json.dumps(result), flush=True)
        if args.out:
            save_records(args.out, result, args)


def save_records(path: str, result: dict, args: argparse.Namespace) -> None:
    """The run as troupe bench records: time and steps to the target, final quality, the curve."""
    from troupe.bench.records import Record, save, stamp

    workload = getattr(args, "workload", "cnn")
    quality = QUALITY[workload]
    name = args.name or args.dist_option + (f" (spars {args.spars})" if args.spars is not None else "")
    params = {"target": args.target, "lr": args.lr, "batch_size": args.batch_size, "epochs": args.epochs,
              "eval_every": args.eval_every}
    final = "final_acc" if quality == "accuracy" else "final_ppl"

    def record(metric: str, value, unit: str, **extra) -> Record:
        return Record(benchmark="time_to_accuracy", contestant=name, workload=workload, params={**params, **extra},
                      world_size=result["world_size"], rep=0, metric=metric, value=value, unit=unit)

    out = [record("seconds_to_target", result["seconds_to_target"], "s"),
           record("steps_to_target", result["steps_to_target"], "steps"),
           record("train_seconds", result["train_seconds"], "s"),
           record(final, result[final], "ratio" if quality == "accuracy" else "perplexity")]
    out += [record(quality, value, "ratio" if quality == "accuracy" else "perplexity", step=step, seconds=seconds)
            for step, seconds, value in result["curve"]]
    save(path, out, stamp(Path(__file__).resolve().parents[1]))


if __name__ == "__main__":
    main()
