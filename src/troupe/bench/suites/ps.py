"""Cluster frameworks vs plain all-reduce and PyTorch DDP: time to MNIST accuracy, server updates/s, staleness.

    troupe bench run ps                                # every contestant, 4 processes each
    troupe bench run ps --args --straggler             # worker 1 runs 2x slower
    troupe bench run ps --args --contestants allreduce,downpour --reps 3 --straggler
    troupe bench run ps --args --workers 2 --straggler # 2 computing workers each: the 2 cores are not oversubscribed

Every contestant trains the CNN of examples/mnist_cnn.py (SGD lr 0.05, momentum 0.9,
weight decay 1e-5, batch 64 per worker) on real MNIST with 4 processes; the training
code (benchmarks/ps_job.py) is one script, only the launch differs. Worker 0 keeps a copy of its
parameters every --snapshot-every steps with the training time so far, and evaluates
the copies on the whole test set (10,000 images) after training, so evaluation never
slows training down. The time to an accuracy is the training time of the first copy at
or above it. Servers report slice updates per second and the staleness of the updates
they applied (versions applied in between); Hogwild's master copies the same for merges.
Contestants run in turns, repetition by repetition (A B C, A B C, ...): the table gives
the median over repetitions. `--out FILE` appends every run as troupe bench records (JSON
lines; `troupe bench table FILE`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from troupe.bench.jobs import run_job
from troupe.bench.suites.generic import plot, table  # noqa: F401  (the registry renders records with them)

JOB = "benchmarks/ps_job.py"

CONTESTANTS = {
    # every contestant uses 4 processes
    "ddp": ["-n", "4"],  # PyTorch DistributedDataParallel, 4 workers
    "plain": ["-n", "4"],  # troupe.DistOpt all-reduce, 4 workers
    "sandblaster": ["--nworkers-per-group", "3", "--nservers-per-group", "1", "--server-worker-separate"],
    "allreduce": ["-n", "4", "--framework", "allreduce"],
    "downpour": ["--nworker-groups", "3", "--nservers-per-group", "1", "--server-worker-separate"],
    "hogwild": ["-n", "4", "--framework", "hogwild"],
    "downpour-sum": ["--nworker-groups", "3", "--nservers-per-group", "1", "--server-worker-separate",
                     "--group-merge", "sum"],  # SINGA's rule: every group's update at the full learning rate
}


def equal_workers(w: int) -> dict[str, list[str]]:
    """Every contestant with `w` computing workers (the separate servers come on top)."""
    n = ["-n", str(w)]
    return {
        "ddp": n, "plain": n, "allreduce": [*n, "--framework", "allreduce"], "hogwild": [*n, "--framework", "hogwild"],
        "sandblaster": ["--nworkers-per-group", str(w), "--nservers-per-group", "1", "--server-worker-separate"],
        "downpour": ["--nworker-groups", str(w), "--nservers-per-group", "1", "--server-worker-separate"],
        "downpour-sum": ["--nworker-groups", str(w), "--nservers-per-group", "1", "--server-worker-separate",
                         "--group-merge", "sum"],
        "downpour-fetch4": ["--nworker-groups", str(w), "--nservers-per-group", "1", "--server-worker-separate",
                            "--fetch-freq", "4"],  # Downpour's n_fetch: fresh values every 4 steps
        # the fresh values arrive while the next step computes (a delay of one own step)
        "downpour-bg": ["--nworker-groups", str(w), "--nservers-per-group", "1", "--server-worker-separate",
                        "--fetch", "background"],
        # ... and each update at the full rate divided by its staleness (Zhang et al. 2016)
        "downpour-bg-inverse": ["--nworker-groups", str(w), "--nservers-per-group", "1", "--server-worker-separate",
                                "--fetch", "background", "--group-merge", "sum", "--staleness-lr", "inverse"],
        # ... and each worker adds its own update, predicted by its optimizer, until the server's values hold it
        "downpour-predict": ["--nworker-groups", str(w), "--nservers-per-group", "1", "--server-worker-separate",
                             "--fetch", "predict"],
        "downpour-bg-mean-inverse": ["--nworker-groups", str(w), "--nservers-per-group", "1",
                                     "--server-worker-separate", "--fetch", "background", "--staleness-lr", "inverse"],
        # half the bytes each way: fp16 gradients to the server, fp16 values back (the server keeps fp32)
        "downpour-fp16": ["--nworker-groups", str(w), "--nservers-per-group", "1", "--server-worker-separate",
                          "--wire-dtype", "fp16"],
        "downpour-predict-fp16": ["--nworker-groups", str(w), "--nservers-per-group", "1",
                                  "--server-worker-separate", "--fetch", "predict", "--wire-dtype", "fp16"],
        # SINGA's rule (every group's update at the full rate) with the worker's own update predicted
        "downpour-predict-sum": ["--nworker-groups", str(w), "--nservers-per-group", "1", "--server-worker-separate",
                                 "--fetch", "predict", "--group-merge", "sum"],
    }


VARIANT = re.compile(r"(?P<base>.+?)(?:-m(?P<momentum>[0-9.]+))?(?:-s(?P<steps>[0-9]+))?")
"""A contestant's name may end in -m<momentum> (e.g. downpour-sum-m0.7): the same launch, trained with
that momentum instead of 0.9. Asynchrony adds momentum of its own (about 1 - 1/M with M asynchronous
workers, Mitliagkas et al. 2016), so the explicit one may be lowered. Then -s<steps> (downpour-s2000):
worker 0 trains that many steps instead of --steps, so that a contestant whose steps are faster trains
about as long as the others and final accuracies compare at equal time."""


def variant(name: str) -> tuple[str, float]:
    """(the launch's name, the momentum) of a contestant's name."""
    m = VARIANT.fullmatch(name)
    return m["base"], float(m["momentum"]) if m["momentum"] else 0.9


def steps_of(name: str, default: int) -> int:
    """The steps of worker 0 a contestant trains (its -s<steps>, else `default`)."""
    steps = VARIANT.fullmatch(name)["steps"]
    return int(steps) if steps else default


def launch_args(name: str, workers: int | None) -> list[str]:
    table = equal_workers(workers) if workers else CONTESTANTS
    return table[variant(name)[0]]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="troupe bench run ps --args", description=__doc__.splitlines()[0])
    p.add_argument("--contestants", default=",".join(CONTESTANTS))
    p.add_argument("--steps", type=int, default=500, help="training steps of worker 0")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--targets", default="0.985,0.989", help="test accuracies to time")
    p.add_argument("--snapshot-every", type=int, default=20)
    p.add_argument("--test-size", type=int, default=10000)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--straggler", action="store_true", help="worker 1 sleeps as long as it computes (2x slower)")
    p.add_argument("--workers", type=int, default=None,
                   help="give every contestant this many computing workers (servers on top) instead of 4 processes")
    p.add_argument("--json", default=None, help="append every run's result to this JSON-lines file")
    p.add_argument("--out", default=None, help="append every run as troupe bench records (JSON lines)")
    p.add_argument("--table", default=None, metavar="JSONL", help="only print the table of the runs saved in JSONL")
    return p.parse_args(argv)


SERVER_LINE = re.compile(
    r"troupe server rank \d+: (\d+) slice updates in ([\d.]+)s \((\d+)/s\), staleness mean ([\d.]+) max (\d+)"
)
SYNC_LINE = re.compile(r"troupe group sync rank \d+: (\d+) merges into its master copies \(staleness mean ([\d.]+) "
                       r"max (\d+)\)")


def run_one(name: str, args) -> dict:
    launch = launch_args(name, args.workers)
    cmd = [JOB, "--worker", "ddp" if name == "ddp" else "troupe", "--steps", str(steps_of(name, args.steps)),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--momentum", str(variant(name)[1]),
           "--targets", args.targets,
           "--snapshot-every", str(args.snapshot_every), "--test-size", str(args.test_size)]
    if args.straggler:
        cmd.append("--straggler")
    done = run_job(cmd, None, flags=launch, threads=None, env={"OMP_NUM_THREADS": "1"})
    found = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.failed or not found:
        raise RuntimeError(f"{name} failed (code {done.codes[0]}):\n{done.stderr[-3000:]}")
    row = {"contestant": name, "straggler": args.straggler, "workers": args.workers, **found[0]}
    servers = [m.groups() for m in SERVER_LINE.finditer(done.stderr)]
    if servers:
        row["server_updates_per_s"] = sum(int(u) for u, *_ in servers) / max(float(s) for _, s, *_ in servers)
        row["staleness_mean"] = max(float(m) for *_, m, _ in servers)
        row["staleness_max"] = max(int(x) for *_, x in servers)
    merges = [m.groups() for m in SYNC_LINE.finditer(done.stderr)]
    if merges:
        row["staleness_mean"] = max(float(m) for _, m, _ in merges)
        row["staleness_max"] = max(int(x) for *_, x in merges)
    return row


def to_records(row: dict, args, targets: list[float]) -> list:
    """One run's row as troupe bench records (a time not reached has value None)."""
    from troupe.bench.records import Record

    units = {**{f"time_to_{t}": "s" for t in targets}, **{f"steps_to_{t}": "steps" for t in targets},
             "final_acc": "ratio", "steps_per_s": "1/s", "server_updates_per_s": "1/s", "staleness_mean": "count"}
    params = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "straggler": args.straggler,
              "workers": args.workers}
    world = args.workers or 4
    return [Record(benchmark="ps", contestant=row["contestant"], workload="cnn", params=params, world_size=world,
                   rep=row["rep"], metric=key, value=row.get(key), unit=unit)
            for key, unit in units.items() if key in row]


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if len(values) == len(rows) else None


def rows_table(results: dict[str, list[dict]], targets: list[float], base: str | None) -> str:
    head = ["contestant"] + [f"time to {t:.1%} (s)" for t in targets] + \
        [f"time to {targets[0]:.1%} / {base}'s" for _ in targets[:1] if base] + ["steps to first", "final acc", "worker steps/s",
                                                             "server slice updates/s", "staleness mean/max"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    base_time = _median(results[base], f"time_to_{targets[0]}") if base in results else None
    for name, rows in results.items():
        times = [_median(rows, f"time_to_{t}") for t in targets]
        cells = [name] + ["not reached" if v is None else f"{v:.1f}" for v in times]
        if base:
            cells.append("-" if times[0] is None or not base_time else f"{times[0] / base_time:.2f}")
        steps = _median(rows, f"steps_to_{targets[0]}")
        ups = _median(rows, "server_updates_per_s")
        stale = (f"{statistics.median(r['staleness_mean'] for r in rows):.2f} / {max(r['staleness_max'] for r in rows)}"
                 if "staleness_mean" in rows[0] else
                 f"{statistics.median(r['worker_staleness_mean'] for r in rows):.2f} / "
                 f"{max(r['worker_staleness_max'] for r in rows)}")
        cells += ["-" if steps is None else f"{steps:.0f}", f"{statistics.median(r['final_acc'] for r in rows):.4f}",
                  f"{statistics.median(r['steps_per_s'] for r in rows):.1f}", "-" if ups is None else f"{ups:.0f}",
                  stale]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.contestants.split(",") if n.strip()]
    launches = equal_workers(args.workers) if args.workers else CONTESTANTS
    unknown = sorted(n for n in names if variant(n)[0] not in launches)
    if unknown:
        raise ValueError(f"unknown contestant(s) {unknown}; choose from {sorted(launches)}, each optionally "
                         "ending in -m<momentum> and then -s<steps>")
    targets = sorted(float(t) for t in args.targets.split(","))
    results: dict[str, list[dict]] = {n: [] for n in names}
    if args.out:
        from troupe.bench.records import save, stamp
        from troupe.bench.records import checkout_root

        started = stamp(checkout_root())
    if args.table:  # runs saved earlier (several invocations may have appended to one file)
        for row in map(json.loads, Path(args.table).read_text().splitlines()):
            if row["contestant"] in results and row["straggler"] == args.straggler \
                    and row.get("workers") == args.workers:
                results[row["contestant"]].append(row)
        print(rows_table({n: r for n, r in results.items() if r}, targets, "plain" if "plain" in names else None))
        return 0
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:  # A B C, C B A, ...
            row = run_one(name, args)
            row["rep"] = rep
            results[name].append(row)
            print(f"rep {rep} {name}: " + ", ".join(f"{t:.1%} at {row[f'time_to_{t}']}s" for t in targets)
                  + f", final {row['final_acc']:.4f}", file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
            if args.out:
                save(args.out, to_records(row, args, targets), started)
    base = "plain" if "plain" in names else None
    print(f"# {args.steps} steps of worker 0, batch {args.batch_size}/worker, lr {args.lr}, {args.reps} rep(s)"
          + (", worker 1 slowed 2x" if args.straggler else ""))
    print(rows_table(results, targets, base))
    return 0
