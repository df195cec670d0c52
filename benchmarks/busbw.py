"""Bus bandwidth of troupe's bucketed all-reduce on simulated hosts, against the line rate and a flat all-reduce.

    sudo python benchmarks/busbw.py --hosts 2 4 --rates 1gbit 10gbit --sizes 1 4 16 64 --reps 11
    troupe run -n 2 benchmarks/busbw.py job --sizes 1 4 --reps 3 --steps 3     # one job, on loopback

Each cell is one job on `--hosts` simulated hosts (one network namespace each, a veth to one bridge,
tbf at the rate; `troupe.bench.netns`), one process and one thread per host, Gloo. In the job the
two contestants of `troupe bench run collectives` take turns call by call in the same processes
(`troupe.observe.turns.run_ab`, the order reversed every other call and repetition): one flat
all-reduce of S bytes, and DistOpt's synchronize() of 8 gradients of S/8 bytes (its buckets). Per
contestant, the median over repetitions of the per-repetition median call (the slowest rank's).

Bus bandwidth is S / t * 2(n-1)/n, what each host's link carries per second under a ring
all-reduce (NCCL's definition), so it compares with the line rate directly; the table gives it
as a fraction of the rate. Rank 0 of each job prints one JSON line per size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def job(args: argparse.Namespace) -> None:
    """One simulated host's process: measure every size, rank 0 prints the medians."""
    import torch

    from troupe.bench.suites.collectives import FLAT, TROUPE, _contestants
    from troupe.observe.turns import Schedule, run_ab
    from troupe.runtime import world

    torch.set_num_threads(1)
    comm = world.init().comm
    for mib in args.sizes:
        size = int(mib * MIB)
        contestants, sgd = _contestants(size, None)
        measured = run_ab(contestants, Schedule(reps=args.reps, steps=args.steps, burnin=args.burnin), comm)
        per_rep = {c.name: [m.value for m in measured if m.contestant == i and m.metric == "step_time"]
                   for i, c in enumerate(contestants)}
        if comm.rank == 0:
            print(json.dumps({"bytes": size, "world": comm.world_size, "reps": args.reps,
                              "flat_s": statistics.median(per_rep[FLAT]), "troupe_s": statistics.median(per_rep[TROUPE]),
                              "ratios": [t / f for t, f in zip(per_rep[TROUPE], per_rep[FLAT])],
                              "buckets": contestants[1].params["buckets"]}), flush=True)
        del sgd, contestants


def rate_bits(rate: str) -> float:
    """tc's spelling ("1gbit", "100mbit") in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"a rate like 1gbit or 100mbit, got {rate!r}")


def drive(args: argparse.Namespace) -> None:
    from troupe.bench.jobs import run_job
    from troupe.bench.netns import available

    why_not = available()
    if why_not:
        raise SystemExit(f"busbw: simulated hosts are not available here ({why_not})")
    script = ["benchmarks/busbw.py", "job", "--sizes", *map(str, args.sizes), "--reps", str(args.reps),
              "--steps", str(args.steps), "--burnin", str(args.burnin)]
    print("| hosts | link | size | flat all-reduce | troupe buckets | troupe / flat | per-rep ratio (min-max) "
          "| bus bandwidth flat | bus bandwidth troupe | troupe / line rate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.hosts:
        for rate in args.rates:
            done = run_job(script, n, link=rate, timeout=args.timeout).check(1500)
            line = rate_bits(rate) / 8
            for row in (json.loads(x) for x in done.outs[0].splitlines() if x.startswith("{")):
                s, f, t = row["bytes"], row["flat_s"], row["troupe_s"]
                bus = lambda sec: s / sec * 2 * (n - 1) / n  # noqa: E731
                if args.out:
                    with open(args.out, "a") as out:
                        out.write(json.dumps({"hosts": n, "rate": rate, **row}) + "\n")
                print(f"| {n} | {rate} | {s // MIB} MiB | {f * 1e3:.1f} ms | {t * 1e3:.1f} ms | {t / f:.2f} "
                      f"| {min(row['ratios']):.2f}-{max(row['ratios']):.2f} | {bus(f) / 1e6:.0f} MB/s "
                      f"| {bus(t) / 1e6:.0f} MB/s | {bus(t) / line:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", choices=["drive", "job"], default="drive")
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64], help="MiB per all-reduce")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--steps", type=int, default=5, help="timed calls per contestant and repetition")
    p.add_argument("--burnin", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="append every row as a JSON line")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    job(args) if args.mode == "job" else drive(args)


if __name__ == "__main__":
    main()
