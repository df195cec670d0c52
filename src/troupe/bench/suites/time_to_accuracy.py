"""time_to_accuracy: training time until the MNIST CNN reaches a test accuracy, for one dist_option.

    troupe bench run time_to_accuracy --out tta.jsonl --args -n 2 --dist-option sparseTopK --spars 0.01
    troupe bench run time_to_accuracy --args -n 2 --link 100mbit --dist-option sparseTopK --spars 0.01
    troupe bench run time_to_accuracy --args -n 4 --link 100mbit --run-flags "--framework diloco --nworker-groups 4 \
        --sync-freq 50 --pseudo-grad-dtype int4" --name "diloco H=50 int4" --eval-every 100

One job of benchmarks/time_to_accuracy.py (the workload: its options follow) under
`troupe run -n N --threads 1`, on loopback or, with ``--link`` ("none" or a tc rate), one
simulated host per rank (`troupe.bench.jobs`; needs root). Rank 0's JSON line and, with
``--out``, its records (the curve as "accuracy" records: `troupe bench plot FILE out.png`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from troupe.bench.jobs import run_job
from troupe.bench.suites.generic import plot, table  # noqa: F401  (the registry renders records with them)

JOB = "benchmarks/time_to_accuracy.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="troupe bench run time_to_accuracy --args", description=__doc__.splitlines()[0],
                                epilog=f"Other options go to {JOB} (--dist-option, --spars, --epochs, --target, ...).")
    p.add_argument("-n", "--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--link", default=None, help="simulated hosts: 'none' or a tc rate such as 100mbit (root)")
    p.add_argument("--delay", default=None, help="added one-way latency on the simulated links, e.g. 1ms")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the job may take")
    p.add_argument("--out", default=None, help="append rank 0's troupe bench records (JSON lines) here")
    p.add_argument("--run-flags", default="", metavar="FLAGS",
                   help="more troupe run flags, one string, e.g. '--framework diloco --nworker-groups 4 --sync-freq 50'")
    args, job_args = p.parse_known_args(argv)
    if args.out:  # the job runs in the checkout: the path as this process sees it
        job_args += ["--out", os.path.abspath(args.out)]
    if args.nproc < 1:
        raise ValueError(f"-n must be >= 1, got {args.nproc}")
    job = run_job([JOB, *job_args], args.nproc, flags=shlex.split(args.run_flags), link=args.link, delay=args.delay,
                  timeout=args.timeout).check()
    sys.stdout.write(job.stdout)
    return 0
