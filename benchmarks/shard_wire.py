"""Sharding's collectives on simulated hosts: reduce-scatter and all-gather against the line rate.

    sudo python benchmarks/shard_wire.py --hosts 4 --rates 1gbit --sizes 4 16 64 --reps 11
    troupe run -n 4 benchmarks/shard_wire.py job --sizes 1 --reps 3        # one job, on loopback

ZeRO-1/2 and full sharding move a bucket of S bytes with a reduce-scatter and an all-gather, (n-1)/n
of S each on a ring. Each cell is one job on `--hosts` simulated hosts (`troupe.bench.netns`: a network
namespace per host, a veth to one bridge, tbf at the rate), one process and one thread per host, Gloo.
In the job the contestants take turns call by call in the same processes, the order reversed every
repetition:

- ``all_reduce``: Gloo's all-reduce of the bucket (what a sharded DistOpt does on Gloo instead of a
  reduce-scatter: 2(n-1)/n of S on the wire);
- ``gloo_rs``: torch's ``reduce_scatter_tensor`` on Gloo;
- ``ring_rs``: a ring reduce-scatter over Gloo's point-to-point sends (n-1 steps of S/n);
- ``all_gather``: torch's ``all_gather_into_tensor`` on Gloo.

A call's time is the slowest rank's; per contestant the median over repetitions of the per-repetition
median. Bus bandwidth is S (n-1)/n / t for the reduce-scatters and the all-gather and S 2(n-1)/n / t
for the all-reduce: what each host's link carries per second, so it compares with the line rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CONTESTANTS = ("all_reduce", "gloo_rs", "ring_rs", "all_gather")


def ring_reduce_scatter(buf, rank: int, n: int) -> None:
    """Sum `buf` (n equal chunks) over the ranks on a ring of point-to-point sends: chunk `rank` of
    `buf` ends holding the sum (the other chunks hold partial sums)."""
    import torch
    import torch.distributed as dist

    chunks = buf.view(n, -1)
    right, left = (rank + 1) % n, (rank - 1) % n
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):  # chunk c leaves rank c + 1 and gathers every rank's part on its way to c
        ops = [dist.P2POp(dist.isend, chunks[(rank - step - 1) % n], right),
               dist.P2POp(dist.irecv, incoming, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        chunks[(rank - step - 2) % n].add_(incoming)


def job(args: argparse.Namespace) -> None:
    """One simulated host's process: every size, contestants in turns; rank 0 prints one line a size."""
    import torch
    import torch.distributed as dist

    from troupe.runtime import world

    torch.set_num_threads(1)
    comm = world.init().comm
    n, rank = comm.world_size, comm.rank
    for mib in args.sizes:
        numel = int(mib * MIB) // 4 // n * n
        buf = torch.randn(numel)
        part = torch.empty(numel // n)
        expected = buf.clone()
        dist.all_reduce(expected)
        probe = buf.clone()
        ring_reduce_scatter(probe, rank, n)
        assert torch.allclose(probe.view(n, -1)[rank], expected.view(n, -1)[rank], rtol=1e-5, atol=1e-4)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        calls = {
            "all_reduce": lambda: dist.all_reduce(buf),
            "gloo_rs": lambda: dist.reduce_scatter_tensor(part, buf),
            "ring_rs": lambda: ring_reduce_scatter(buf, rank, n),
            "all_gather": lambda: gather(buf, part),
        }
        times: dict[str, list[float]] = {c: [] for c in CONTESTANTS}
        for rep in range(args.burnin + args.reps):
            order = CONTESTANTS if rep % 2 == 0 else CONTESTANTS[::-1]
            per_call: dict[str, list[float]] = {c: [] for c in CONTESTANTS}
            for _ in range(args.steps):
                for name in order:
                    dist.barrier()
                    start = time.perf_counter()
                    calls[name]()
                    took = torch.tensor([time.perf_counter() - start])
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    per_call[name].append(float(took))
            if rep >= args.burnin:
                for name in CONTESTANTS:
                    times[name].append(statistics.median(per_call[name]))
        if rank == 0:
            print(json.dumps({"bytes": numel * 4, "world": n, "reps": args.reps,
                              **{f"{c}_s": statistics.median(times[c]) for c in CONTESTANTS},
                              "ring_over_gloo_rs": [r / g for r, g in zip(times["ring_rs"], times["gloo_rs"])]}),
                  flush=True)


def drive(args: argparse.Namespace) -> None:
    from busbw import rate_bits  # benchmarks/busbw.py: tc's rate spelling in bits per second

    from troupe.bench.jobs import run_job
    from troupe.bench.netns import available

    why_not = available()
    if why_not:
        raise SystemExit(f"shard_wire: simulated hosts are not available here ({why_not})")
    script = ["benchmarks/shard_wire.py", "job", "--sizes", *map(str, args.sizes), "--reps", str(args.reps),
              "--steps", str(args.steps), "--burnin", str(args.burnin)]
    print("| hosts | link | size | all-reduce | Gloo reduce-scatter | ring reduce-scatter | all-gather "
          "| ring / Gloo RS (min-max) | ring RS / line rate | all-gather / line rate | Gloo RS / line rate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.hosts:
        for rate in args.rates:
            done = run_job(script, n, link=rate, timeout=args.timeout).check(1500)
            line = rate_bits(rate) / 8
            for row in (json.loads(x) for x in done.outs[0].splitlines() if x.startswith("{")):
                s = row["bytes"]
                frac = lambda sec: s * (n - 1) / n / sec / line  # noqa: E731
                ratios = row["ring_over_gloo_rs"]
                if args.out:
                    with open(args.out, "a") as out:
                        out.write(json.dumps({"hosts": n, "rate": rate, **row}) + "\n")
                print(f"| {n} | {rate} | {s / MIB:.0f} MiB | {row['all_reduce_s'] * 1e3:.1f} ms "
                      f"| {row['gloo_rs_s'] * 1e3:.1f} ms | {row['ring_rs_s'] * 1e3:.1f} ms "
                      f"| {row['all_gather_s'] * 1e3:.1f} ms "
                      f"| {row['ring_rs_s'] / row['gloo_rs_s']:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
                      f"| {frac(row['ring_rs_s']):.2f} | {frac(row['all_gather_s']):.2f} "
                      f"| {frac(row['gloo_rs_s']):.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", choices=["drive", "job"], default="drive")
    p.add_argument("--hosts", type=int, nargs="+", default=[4])
    p.add_argument("--rates", nargs="+", default=["1gbit"])
    p.add_argument("--sizes", type=float, nargs="+", default=[4, 16, 64], help="MiB per bucket")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--steps", type=int, default=3, help="timed calls per contestant and repetition")
    p.add_argument("--burnin", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="append every row as a JSON line")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    job(args) if args.mode == "job" else drive(args)


if __name__ == "__main__":
    main()
