"""What `troupe bench list | run | table | plot` do (the arguments are parsed in troupe.cli).

    troupe bench list
    troupe bench run collectives -n 2 --reps 11 --out results.jsonl
    troupe bench run ps --out ps.jsonl --args --steps 800      # a job suite: its own options after --args
    troupe bench table results.jsonl
    troupe bench plot results.jsonl out.png
    troupe bench faults --doc docs/network_faults.md          # network faults on simulated hosts
    troupe bench scale --sizes 2 4 8 16 32 64                 # the elastic control plane against N
"""

from __future__ import annotations

import argparse
import json
import sys

from troupe.bench import records as records_mod
from troupe.bench import registry, render
from troupe.bench.options import Options
from troupe.bench.records import Record
from troupe.bench.records import checkout_root
from troupe.runtime.spawn import RankFailed, run_ranks


def _rank_main(rank: int, world_size: int, name: str, options: Options) -> list[Record]:
    """What every rank runs (module level: spawn pickles it by name); rank 0's records are kept."""
    from troupe.runtime.world import init

    measured = registry.get(name).run(rank, world_size, options)
    init().comm.barrier()  # every rank has finished its collectives before any leaves
    return measured if rank == 0 else []


def list_benchmarks() -> str:
    lines = []
    for b in registry.BENCHMARKS.values():
        how = f"jobs: troupe bench run {b.name} --out FILE --args ..." if b.jobs else "harness"
        lines.append(f"{b.name:<17} {b.help} [{how}]")
    return "\n".join(lines)


def run(name: str, options: Options, out: str | None, script_args: list[str]) -> int:
    """Run one benchmark; print its table; append its records to `out`."""
    bench = registry.get(name)
    root = checkout_root()
    if bench.jobs:
        options.with_defaults({}, bench.uses, name)  # a flag the suite does not take is an error
        argv = [*(["--out", out] if out else []), *script_args]
        print(f"troupe bench: {name} {' '.join(argv)}", file=sys.stderr, flush=True)
        return _within(options.timeout, lambda: bench.main(argv))
    if script_args:
        raise ValueError(f"{name} runs in one world: --args is for the job suites only "
                         f"({', '.join(sorted(registry.JOB_SUITES))})")
    options = options.with_defaults(bench.defaults, bench.uses, name)
    stamp = records_mod.stamp(root)
    print(f"troupe bench: {name} on {options.nproc} ranks x {options.threads} thread(s), {options.reps} reps "
          f"(run {stamp.run}, commit {stamp.commit or 'unknown'})", file=sys.stderr, flush=True)
    measured = run_ranks(_rank_main, options.nproc, name, options, threads=options.threads,
                         timeout=options.timeout)[0]
    stamped = [stamp.apply(r) for r in measured]
    if out:
        records_mod.write(out, stamped)
        print(f"troupe bench: {len(stamped)} records appended to {out}", file=sys.stderr)
    print(bench.table(stamped), flush=True)
    return 0


def _within(timeout: float | None, fn) -> int:
    """fn() under SIGALRM after `timeout` seconds (TimeoutError); its jobs are killed by their own timeouts."""
    if not timeout:
        return fn() or 0
    import signal

    def expire(signum, frame):
        raise TimeoutError(f"the benchmark did not finish within {timeout:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(timeout)))
    try:
        return fn() or 0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _select(path: str, benchmark: str | None, run_id: str | None) -> list[Record]:
    found = records_mod.read(path)
    chosen = [r for r in found if (benchmark is None or r.benchmark == benchmark) and (run_id is None or r.run == run_id)]
    if not chosen:
        raise ValueError(f"{path}: no records" + (f" of benchmark {benchmark!r}" if benchmark else "")
                         + (f" of run {run_id!r}" if run_id else ""))
    return chosen


def table(path: str, benchmark: str | None = None, run_id: str | None = None) -> str:
    """Every run in the file (or the chosen one), each rendered by its benchmark's table."""
    parts = []
    for (_, name), rs in render.group(_select(path, benchmark, run_id), lambda r: (r.run, r.benchmark)).items():
        bench = registry.BENCHMARKS.get(name)
        parts.append(f"## {name}\n\n" + (bench.table(rs) if bench else render.generic_table(rs)))
    return "\n\n".join(parts)


def plot(path: str, out: str, benchmark: str | None = None, run_id: str | None = None) -> None:
    chosen = _select(path, benchmark, run_id)
    names = sorted({r.benchmark for r in chosen})
    if len(names) > 1:
        raise ValueError(f"{path} holds several benchmarks {names}: choose one with --benchmark")
    bench = registry.BENCHMARKS.get(names[0])
    (bench.plot if bench else lambda rs, o: render.plot_bars(rs, o, metric=rs[0].metric))(chosen, out)


def main(args: argparse.Namespace) -> int:
    """Dispatch `troupe bench ...`; bad input becomes a message and exit code 2."""
    try:
        if args.bench_command == "list":
            print(list_benchmarks())
            return 0
        if args.bench_command == "run":
            return run(args.name, options_from(args), args.out, args.script_args)
        if args.bench_command == "conformance":  # `troupe bench run conformance --args ...`, as issue 47 spells it
            rest = args.matrix_args[1:] if args.matrix_args[:1] == ["--"] else args.matrix_args
            return run("conformance", Options(), None, rest)
        if args.bench_command == "faults":
            from troupe.bench import network_faults

            return network_faults.main(args.regimes, args.faults or list(network_faults.FAULTS), args.steps,
                                       args.pace, args.seed, args.doc, args.out, args.workdir)
        if args.bench_command == "chaos":
            from troupe.bench.chaos import run as run_chaos

            print(json.dumps(run_chaos(args), indent=1))
            return 0
        if args.bench_command == "scale":
            from troupe.bench.scale import run as run_scale

            run_scale(args)
            return 0
        if args.bench_command == "table":
            print(table(args.results, args.benchmark, args.run))
            return 0
        plot(args.results, args.out, args.benchmark, args.run)
        print(f"troupe bench: plot written to {args.out}", file=sys.stderr)
        return 0
    except (ValueError, FileNotFoundError, ImportError, TimeoutError, RankFailed) as e:
        print(f"troupe bench: {e}", file=sys.stderr)
        return 2


def options_from(args: argparse.Namespace) -> Options:
    """The Options of `troupe bench run` (None where a flag was not given)."""
    def tup(value):
        return None if value is None else tuple(value)

    return Options(reps=args.reps, steps=args.steps, burnin=args.burnin, nproc=args.nproc, threads=args.threads,
                   workloads=tup(args.workloads), data=args.data, batch_size=args.batch_size, sizes=tup(args.sizes),
                   bucket_size=args.bucket_size, sweep=args.sweep, local=args.local, flat=args.flat,
                   dist_options=tup(args.dist_options), powersgd_ranks=tup(args.powersgd_ranks), micro=args.micro, clip=args.clip, seed=args.seed,
                   timeout=args.timeout)
