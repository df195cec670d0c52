"""`troupe bench`'s command line: its sub-commands and their flags (cli.py adds them to `troupe`'s parser;
`command.py` runs what they ask for). Imports nothing heavy: the CLI starts without torch."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _typed(parse):
    """An argparse type from a troupe.bench parser (its ValueError becomes argparse's message)."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def add_bench_parser(sub, positive: Callable[[str], int]) -> None:
    """`troupe bench list | run NAME | table FILE | plot FILE OUT` under `sub`, argparse's sub-parsers of the
    `troupe` command (troupe.bench.command does the work). `positive`: the type of a count (>= 1)."""
    from troupe.bench.options import parse_bucket, parse_size

    bench = sub.add_parser("bench", help="benchmarks: list, run, table, plot (one harness, JSON-lines results)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bsub.add_parser("list", help="the benchmarks and what each measures")
    run = bsub.add_parser("run", help="run one benchmark, print its table, append its records to --out")
    run.add_argument("name", help="a name from `troupe bench list`")
    run.add_argument("--out", default=None, help="append the records (JSON lines) to this file")
    run.add_argument("--reps", type=positive, default=None, help="repetitions (median over them)")
    run.add_argument("--steps", type=positive, default=None, help="measured steps per repetition and contestant")
    run.add_argument("--burnin", type=int, default=None, help="untimed steps per contestant before measuring")
    run.add_argument("-n", "--nproc", type=positive, default=None, help="ranks (local processes; default 2)")
    run.add_argument("--threads", type=positive, default=None, help="torch threads per rank (default 1)")
    run.add_argument("--workload", dest="workloads", nargs="+", default=None, help="cnn, resnet18, mlp")
    run.add_argument("--data", choices=["mnist", "synthetic"], default=None)
    run.add_argument("--batch-size", type=positive, default=None, help="per rank")
    run.add_argument("--sizes", type=_typed(parse_size), nargs="+", default=None,
                     help="bytes per all-reduce: 4096, 64KiB, 16MiB (collectives)")
    run.add_argument("--bucket-size", type=_typed(parse_bucket), default=None, help="troupe's, in elements")
    run.add_argument("--sweep", type=_typed(lambda t: tuple(parse_bucket(x) for x in t.split(","))),
                     default=None, help="troupe bucket sizes, comma-separated: 2**16,2**19,all (ddp)")
    run.add_argument("--local", action="store_true", default=None, help="also the model with no communication")
    run.add_argument("--flat", action="store_true", default=None, help="also backward + one flat all-reduce (ddp)")
    run.add_argument("--dist-options", nargs="+", default=None, help="dist_options to compare (compression)")
    run.add_argument("--powersgd-ranks", type=positive, nargs="+", default=None,
                     help="PowerSGD ranks to compare with torch's powerSGD_hook (powersgd; default 1 2 4)")
    run.add_argument("--micro", type=positive, default=None, help="micro-batches per step (accumulate)")
    run.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ max_norm (accumulate)")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--timeout", type=float, default=None, help="seconds before the run's ranks are killed")
    run.add_argument("--args", dest="script_args", nargs=argparse.REMAINDER, default=[],
                     help="everything after --args goes to a job suite (throughput, ps, ...): its own options")
    conformance = bsub.add_parser("conformance", add_help=False,
                                  help="every regime with every script and launcher (docs/conformance.md): "
                                       "`troupe bench run conformance --args ...`, its options after it")
    conformance.add_argument("matrix_args", nargs=argparse.REMAINDER)
    faults = bsub.add_parser("faults", help="network faults injected into jobs on simulated hosts (root)")
    faults.add_argument("--regimes", nargs="+", default=["plain-2", "plain-4", "topk-4", "downpour-4", "hogwild-4"])
    faults.add_argument("--faults", nargs="+", default=None, help="default: every fault")
    faults.add_argument("--steps", type=positive, default=80, help="training steps per job")
    faults.add_argument("--pace", type=float, default=0.25, help="seconds of simulated compute per step")
    faults.add_argument("--seed", type=int, default=0, help="picks the step each fault starts at")
    faults.add_argument("--doc", default=None, help="rewrite the table between its markers in this file")
    faults.add_argument("--out", default=None, help="append every cell as a JSON line")
    faults.add_argument("--workdir", default="/tmp/troupe-faults", help="each job's output and checkpoints")
    chaos = bsub.add_parser("chaos", help="an elastic job (troupe run --elastic) under a SIGKILL/SIGSTOP schedule")
    from troupe.bench.chaos import add_arguments as add_chaos_arguments

    add_chaos_arguments(chaos)
    scale = bsub.add_parser("scale", help="an elastic job's control plane against its number of processes, measured "
                                          "and fitted (docs/scale.md)")
    from troupe.bench.scale import add_arguments as add_scale_arguments

    add_scale_arguments(scale)
    table = bsub.add_parser("table", help="markdown tables of a JSON-lines results file")
    table.add_argument("results")
    plot = bsub.add_parser("plot", help="a matplotlib plot of a JSON-lines results file")
    plot.add_argument("results")
    plot.add_argument("out", help="image file (.png, .svg, ...)")
    for p in (table, plot):
        p.add_argument("--benchmark", default=None, help="only this benchmark's records")
        p.add_argument("--run", default=None, help="only this run's records (its id)")
