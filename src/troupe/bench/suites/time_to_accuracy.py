"""time_to_accuracy: training time until a model reaches a quality, for one contestant or issue 28's whole list.

    troupe bench run time_to_accuracy --out tta.jsonl --args -n 2 --dist-option sparseTopK --spars 0.01
    troupe bench run time_to_accuracy --args -n 2 --link 100mbit --dist-option sparseTopK --spars 0.01
    troupe bench run time_to_accuracy --args -n 4 --link 100mbit --run-flags "--framework diloco --nworker-groups 4 \
        --sync-freq 50 --pseudo-grad-dtype int4" --name "diloco H=50 int4" --eval-every 100
    troupe bench run time_to_accuracy --out tta.jsonl --args -n 4 --link 100mbit --contestants all \
        --workload word_lm --epochs 10

One job of benchmarks/time_to_accuracy.py (the workload: its options follow) under
`troupe run -n N --threads 1`, on loopback or, with ``--link`` ("none" or a tc rate), one
simulated host per rank (`troupe.bench.jobs`; needs root). Rank 0's JSON line and, with
``--out``, its records (the curve as "accuracy" or "perplexity" records: `troupe bench plot FILE
out.png`). With ``--contestants``, one job per contestant of `CONTESTANTS` (plain first), one
after the other with the same options, and then the table that compares them (`compare`): the
time to the target (the MNIST CNN: ``--target``, 98.5 %; the word LM: within 2 % of plain's final
perplexity, read off each curve), relative to plain, and the final quality.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass

from troupe.bench.jobs import run_job
from troupe.bench.suites.generic import plot, table  # noqa: F401  (the registry renders records with them)

JOB = "benchmarks/time_to_accuracy.py"


@dataclass(frozen=True)
class Contestant:
    """One way to train, as the job's options and troupe run's flags; `period`: steps between exchanges."""

    key: str
    """What ``--contestants`` calls it."""
    name: str
    job: tuple[str, ...] = ()
    flags: str = ""
    """troupe run flags; ``{n}`` is the job's process count."""
    period: int = 1
    """Steps between the groups' exchanges (Hogwild, DiLoCo): evaluations fall on multiples of it."""


def _diloco(h: int, dtype: str = "fp32", streaming: bool = False) -> Contestant:
    cast = f" --pseudo-grad-dtype {dtype}" if dtype != "fp32" else ""
    more, kind = (" --fragments 4 --delay 5", "streaming") if streaming else ("", "diloco")
    name = f"Streaming DiLoCo H = {h}, K = 4, τ = 5, {dtype}" if streaming else f"DiLoCo H = {h}, {dtype}"
    return Contestant(f"{kind}{h}" + (f"-{dtype}" if dtype != "fp32" else ""), name,
                      flags=f"--framework diloco --nworker-groups {{n}} --sync-freq {h}{cast}{more}", period=h)


CONTESTANTS = (
    Contestant("plain", "plain all-reduce"),
    Contestant("topk", "top-K 0.01", job=("--dist-option", "sparseTopK", "--spars", "0.01")),
    *(Contestant(f"powersgd{r}", f"PowerSGD r = {r}", job=("--dist-option", "powerSGD", "--powersgd-rank", str(r)))
      for r in (1, 2, 4)),
    Contestant("hogwild10", "Distributed Hogwild, H = 10", flags="--framework hogwild --sync-freq 10", period=10),
    _diloco(20), _diloco(50), _diloco(50, "int8"), _diloco(100, "int4"), _diloco(50, "int4", streaming=True),
    Contestant("diloco20-avg", "DiLoCo H = 20, fp32, outer SGD lr 1 without momentum (model averaging)",
               flags="--framework diloco --nworker-groups {n} --sync-freq 20 --outer-optimizer SGD --outer-lr 1 "
                     "--outer-momentum 0", period=20),
)
"""Issue 28's contestants, plain first (the others are compared with it)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="troupe bench run time_to_accuracy --args", description=__doc__.splitlines()[0],
                                epilog=f"Other options go to {JOB} (--workload, --dist-option, --spars, --epochs, "
                                       "--target, --eval-every, ...).")
    p.add_argument("-n", "--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--link", default=None, help="simulated hosts: 'none' or a tc rate such as 100mbit (root)")
    p.add_argument("--delay", default=None, help="added one-way latency on the simulated links, e.g. 1ms")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the job may take")
    p.add_argument("--out", default=None, help="append rank 0's troupe bench records (JSON lines) here")
    p.add_argument("--run-flags", default="", metavar="FLAGS",
                   help="more troupe run flags, one string, e.g. '--framework diloco --nworker-groups 4 --sync-freq 50'")
    p.add_argument("--contestants", default=None, metavar="KEYS",
                   help=f"'all' or some of {','.join(c.key for c in CONTESTANTS)} (comma-separated): one job each, "
                        "plain first, then the table")
    args, job_args = p.parse_known_args(argv)
    if args.out:  # the job runs in the checkout: the path as this process sees it
        job_args += ["--out", os.path.abspath(args.out)]
    if args.nproc < 1:
        raise ValueError(f"-n must be >= 1, got {args.nproc}")
    if args.contestants is None:
        sys.stdout.write(_run(args, job_args, shlex.split(args.run_flags)))
        return 0
    results = []
    for c in chosen(args.contestants):
        flags = shlex.split(args.run_flags) + shlex.split(c.flags.format(n=args.nproc))
        period = ["--period", str(c.period)] if c.period > 1 else []
        line = _run(args, [*job_args, *c.job, *period, "--name", c.name, "--eval-every", str(_every(job_args, c))],
                    flags)
        sys.stdout.write(line)
        sys.stdout.flush()
        results.append({**json.loads(line.strip().splitlines()[-1]), "flags": " ".join([*c.job, *flags])})
    print()
    print(compare(results, _target(job_args)))
    return 0


def chosen(keys: str) -> list[Contestant]:
    """The contestants named by their keys (comma-separated, or 'all'), plain always first; unknown: ValueError."""
    if keys == "all":
        return list(CONTESTANTS)
    by_key = {c.key: c for c in CONTESTANTS}
    out = [CONTESTANTS[0]]
    for key in (k.strip() for k in keys.split(",") if k.strip()):
        if key not in by_key:
            raise ValueError(f"--contestants: no contestant is called {key!r}; they are: {', '.join(by_key)}")
        out += [by_key[key]] if by_key[key] not in out else []
    return out


def _run(args: argparse.Namespace, job_args: list[str], flags: list[str]) -> str:
    job = run_job([JOB, *job_args], args.nproc, flags=flags, link=args.link, delay=args.delay,
                  timeout=args.timeout).check()
    return job.stdout


def _option(job_args: list[str], name: str, default: str | None) -> str | None:
    """The last value of `name` among the job's own options (they are parsed there)."""
    value = default
    for i, a in enumerate(job_args):
        if a == name and i + 1 < len(job_args):
            value = job_args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _every(job_args: list[str], c: Contestant) -> int:
    """The contestant's evaluation period: the smallest multiple of its exchange period >= --eval-every."""
    base = int(_option(job_args, "--eval-every", "100"))
    return math.ceil(base / c.period) * c.period


def _target(job_args: list[str]) -> float | None:
    """The accuracy the CNN is timed to (None for the word LM: plain's final perplexity sets it)."""
    if _option(job_args, "--workload", "cnn") != "cnn":
        return None
    return float(_option(job_args, "--target", "0.985"))


PPL_SLACK = 1.02
"""The word LM is timed to plain's final perplexity times this (issue 28: within 2 %)."""


def compare(results: list[dict], target: float | None) -> str:
    """Markdown: each contestant's time to the target against plain's (the first result) and its final quality.

    `target`: the CNN's accuracy; None: the word LM's, plain's final perplexity x `PPL_SLACK`. The time
    is the first evaluation at or past the target on each result's curve (step, seconds, quality)."""
    plain = results[0]
    ppl = target is None
    if ppl:
        target = plain["final_ppl"] * PPL_SLACK
    quality = "final perplexity" if ppl else "final accuracy"
    goal = f"perplexity {target:.2f} (plain's final x {PPL_SLACK})" if ppl else f"accuracy {target:g}"
    head = [f"Time to {goal}: the first evaluation there.", "",
            f"| contestant | flags | seconds to it | / plain | steps to it | train s (steps) | s per step "
            f"(per exchange step) | {quality} |" + (" / plain |" if ppl else ""),
            "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if ppl else "")]
    first = _reached(plain["curve"], target, ppl)
    rows = []
    for r in results:
        when = _reached(r["curve"], target, ppl)
        final = r["final_ppl"] if ppl else r["final_acc"]
        ratio = f"{when[1] / first[1]:.2f}" if when and first else "–"
        row = (f"| {r['option']} | `{r['flags']}` | {when[1] if when else 'not reached'} | {ratio} | "
               f"{when[0] if when else '–'} | {r['train_seconds']} ({r['steps']}) | {_per_step(r)} | {final:.4g} |")
        if ppl:
            row += f" {final / plain['final_ppl']:.3f} |"
        rows.append(row.replace("``", ""))
    return "\n".join(head + rows)


def _per_step(r: dict) -> str:
    """Seconds per step; for a contestant that exchanges every period-th step, the other steps' and (the
    exchange steps')."""
    n, seconds = r["steps"], r["train_seconds"]
    k, apart = r.get("exchanges", 0), r.get("exchange_seconds", 0.0)
    if not k or k >= n:
        return f"{seconds / max(n, 1):.3f}"
    return f"{(seconds - apart) / (n - k):.3f} ({apart / k:.3f})"


def _reached(curve: list, target: float, lower_is_better: bool) -> tuple[int, float] | None:
    """(step, seconds) of the first point of `curve` at or past `target`, or None."""
    for step, seconds, value in curve:
        if (value <= target) if lower_is_better else (value >= target):
            return step, seconds
    return None
