"""Bytes on the wire per training step, by dist_option (and PS framework), vs dense, cross-checked on veth.

    troupe bench run bytes_per_step --args --plot benchmarks/results/bytes_per_step.png --json benchmarks/results/bytes_per_step.json

Each configuration (benchmarks/bytes_per_step_job.py) trains the example's MNIST CNN (examples/mnist_cnn.py: its model, its
`train_one_batch(x, y, dist_option, spars)`, its SGD settings, batch 64 per worker of real
MNIST) with 2 workers, twice: for `--steps A B` steps. Every process reports the bytes all
of its Communicators counted (`troupe.init().traffic`: payload = bytes handed to
collectives and sent messages, wire = what the textbook algorithm sends): a worker at exit, on
stdout; a server, which `troupe run` starts as `python -m troupe.cluster.bootstrap` (it never runs
the job script), in the `troupe server rank R: traffic {...}` line it writes to stderr as it leaves.
With network namespaces (needs root) every process runs on a simulated host of its own
(`troupe.bench.jobs`), and each host's veth transmit counter is read before and after. Per step = (run B - run A) / (B - A): start-up, rendezvous, the
initial broadcast and shutdown are in both runs and cancel; what remains is steps A+1..B
(plus the watchdog's heartbeats to the store while they run). Bytes are the whole job's
(every process's sends added up) per step of each worker; with --reps R the median of R
such pairs. TCP retransmissions (counted in each namespace) add veth bytes that no counter
sees, so the table gives them too. `--out FILE` appends every pair of runs as troupe bench
records (JSON lines; `troupe bench table FILE`). The last column is what the workers alone sent: under
a parameter server, worker -> server (the rest is the servers' replies).
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

JOB = "benchmarks/bytes_per_step_job.py"

OPTIONS = ["plain", "fp16", "bf16", "partialUpdate", "sparseTopK", "sparseThreshold"]
"""The example's --dist-option values (fp32 is plain under another name)."""

FRAMEWORKS: dict[str, tuple[list[str], int]] = {
    # 2 workers each, as the options' rows; (troupe run flags, processes)
    "allreduce": (["--framework", "allreduce"], 2),
    "hogwild": (["--framework", "hogwild"], 2),
    "sandblaster": (["--nworkers-per-group", "2", "--nservers-per-group", "1", "--server-worker-separate"], 3),
    "sandblaster-fp16": (["--nworkers-per-group", "2", "--nservers-per-group", "1", "--server-worker-separate",
                          "--wire-dtype", "fp16"], 3),
    # the top 1% of each slice's update, with error feedback (the values fetched stay dense)
    "sandblaster-topk": (["--nworkers-per-group", "2", "--nservers-per-group", "1", "--server-worker-separate",
                          "--wire-topk", "0.01"], 3),
    "sandblaster-topk-fp16": (["--nworkers-per-group", "2", "--nservers-per-group", "1", "--server-worker-separate",
                               "--wire-topk", "0.01", "--wire-dtype", "fp16"], 3),
    "downpour": (["--nworker-groups", "2", "--nservers-per-group", "1", "--server-worker-separate"], 3),
}
"""Parameter-server frameworks through `troupe run` (dist_option plain; what the cluster does to the updates is
in its flags; servers' sends counted too)."""

MARK = "BYTES "
SERVER_TRAFFIC = re.compile(r"^troupe server rank (\d+): traffic (\{.*\})$")
"""The line a server rank writes to stderr as it leaves (troupe.cluster.bootstrap.hand_over):
what it sent, by operation, as [payload bytes, wire bytes]."""
WORKERS = 2
"""Workers in every configuration (a step is one update by each)."""



def summary(rank: int, role: str, ops: dict[str, list[int]]) -> dict:
    """A process's report from its counters by operation ([payload bytes, wire bytes] each)."""
    # a message's bytes are counted once, by its sender (a receive buffer is no payload sent)
    payload = sum(p for op, (p, _) in ops.items() if op != "recv")
    wire = sum(w for _, w in ops.values())
    return {"rank": rank, "role": role, "payload": payload, "wire": wire, "ops": dict(sorted(ops.items()))}


def _worker_args(args: argparse.Namespace, option: str, steps: int) -> list[str]:
    spars = {"sparseTopK": args.topk, "sparseThreshold": args.threshold}.get(option)
    return [JOB, "--option", option, "--worker-steps", str(steps), "--batch", str(args.batch),
            "--data", args.data, *(["--spars", str(spars)] if spars is not None else [])]


def _reports(out: str, err: str) -> list[dict]:
    """The workers' reports (stdout) and the servers' (their traffic lines on stderr)."""
    reports = [json.loads(line[len(MARK):]) for line in out.splitlines() if line.startswith(MARK)]
    for line in err.splitlines():
        m = SERVER_TRAFFIC.match(line)
        if m:
            reports.append(summary(int(m.group(1)), "server", json.loads(m.group(2))))
    return reports


def _totals(reports: list[dict], nprocs: int, failed: bool, stderr: str) -> dict[str, float]:
    """Every process's counters added up; a failure after both workers finished is only warned about."""
    ranks = sorted(r["rank"] for r in reports)
    done = sum(r["role"] == "worker" for r in reports)
    if ranks != list(range(nprocs)) or done != WORKERS:
        raise RuntimeError(f"expected reports from ranks 0..{nprocs - 1} with {WORKERS} workers done, got ranks "
                           f"{ranks} with {done} done:\n{stderr[-3000:]}")
    if failed:  # the counters are complete: the failure came at exit, after the measured steps
        why = [line for line in stderr.splitlines() if "troupe run: rank" in line or "terminate" in line]
        print(f"warning: a process failed after reporting its counters: {why}", file=sys.stderr, flush=True)
    return {"payload": sum(r["payload"] for r in reports), "wire": sum(r["wire"] for r in reports),
            "workers_wire": sum(r["wire"] for r in reports if r["role"] == "worker")}


def run_once(flags: list[str], nprocs: int, script: list[str], args: argparse.Namespace) -> dict[str, float]:
    """One job's counters added up; on simulated hosts also `veth` (what the hosts' interfaces sent)."""
    link = "none" if args.net == "netns" else None
    job = run_job(script, nprocs, flags=flags, link=link, timeout=args.timeout)
    reports = [r for out, err in zip(job.outs, job.errs) for r in _reports(out, err)]
    stderr = "\n".join(err[-1500:] for err in job.errs) if link else job.stderr
    totals = _totals(reports, nprocs, job.failed, stderr)
    if link:
        totals.update(veth=sum(job.tx_bytes), retransmits=sum(job.retransmits))
    return totals


def _pair(flags: list[str], nprocs: int, option: str, steps: tuple[int, int], args: argparse.Namespace
          ) -> tuple[dict[str, float], dict[str, float]]:
    """The A-step and the B-step job's totals. On loopback the two jobs run side by side (the counters are
    each process's own, so they do not see each other; most of a short job is its start-up, which then
    overlaps); on simulated hosts one after the other (an interface counts every job's bytes)."""
    jobs = [lambda n=n: run_once(flags, nprocs, _worker_args(args, option, n), args) for n in steps]
    if args.net == "netns":
        return jobs[0](), jobs[1]()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        short, long_ = pool.map(lambda job: job(), jobs)
    return short, long_


def measure(name: str, flags: list[str], nprocs: int, option: str, args: argparse.Namespace,
            sink: list | None = None) -> dict:
    """Bytes per step of one configuration: the difference of a B-step and an A-step run (median of --reps).

    Every pair's values are appended to `sink` as troupe bench records (when given).
    """
    a, b = args.steps
    per_step: dict[str, list[float]] = {}
    retransmits = 0
    for _ in range(args.reps):
        short, long_ = _pair(flags, nprocs, option, (a, b), args)
        retransmits += short.pop("retransmits", 0) + long_.pop("retransmits", 0)
        for key in long_:
            per_step.setdefault(key, []).append((long_[key] - short[key]) / (b - a))
    if sink is not None:
        from troupe.bench.records import Record

        params = {"net": args.net, "steps": list(args.steps), "batch": args.batch, "data": args.data,
                  "option": option, "processes": nprocs}
        sink += [Record(benchmark="bytes_per_step", contestant=name, workload="cnn", params=params, world_size=WORKERS,
                        rep=rep, metric=f"{key}_bytes", value=v, unit="B")
                 for key, values in per_step.items() for rep, v in enumerate(values)]
    row = {"name": name, "processes": nprocs, **{k: statistics.median(v) for k, v in per_step.items()}}
    if args.net == "netns":
        row["retransmits"] = retransmits  # TCP segments sent twice, in all runs of this row
    print(f"{name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in row.items() if k not in ("name", "processes")),
          file=sys.stderr, flush=True)
    return row


def rows_table(rows: list[dict], dense: float) -> str:
    veth = all("veth" in r for r in rows)
    lines = ["| configuration | processes | payload B/step | wire B/step (counters) | veth B/step | veth / wire "
             "| wire vs dense | TCP retransmits | workers' wire B/step |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        v, ratio = (f"{r['veth']:,.0f}", f"{r['veth'] / r['wire']:.3f}" if r["wire"] else "-") if veth else ("-", "-")
        lines.append(f"| {r['name']} | {r['processes']} | {r['payload']:,.0f} | {r['wire']:,.0f} | {v} | {ratio} "
                     f"| {r['wire'] / dense:.4f} | {r.get('retransmits', '-')} | {r['workers_wire']:,.0f} |")
    return "\n".join(lines)


def rows_plot(rows: list[dict], path: str, title: str) -> None:
    """Wire bytes (counters) and veth bytes per step, log scale, each group labelled with its ratio to dense."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    dense = next(r["wire"] for r in rows if r["name"] == "plain")
    kinds = [("wire", "wire bytes (troupe's counters)"), ("veth", "veth transmit bytes (interfaces)")]
    kinds = [(k, label) for k, label in kinds if all(k in r for r in rows)]
    width = 0.8 / len(kinds)
    fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(rows) + 1.5), 4.6))
    for j, (key, label) in enumerate(kinds):
        xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [max(r[key], 1.0) for r in rows], width, label=label, color=["C0", "C2"][j])
    for i, r in enumerate(rows):
        ax.annotate(f"{r['wire'] / dense:.3g}x", (i, max(max(r[k] for k, _ in kinds), 1.0)), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=8)
    ax.axhline(dense, color="grey", linestyle="--", linewidth=0.8, label="plain (dense fp32 all-reduce)")
    options = sum(r["name"] in OPTIONS for r in rows)
    if options < len(rows):
        ax.axvline(options - 0.5, color="black", linewidth=0.6)
        ax.text(options - 0.45, 0.98, "parameter-server frameworks\n(dist_option plain)", va="top", fontsize=8,
                transform=ax.get_xaxis_transform())
    ax.set_yscale("log")
    top = max(max(r[k] for k, _ in kinds) for r in rows)
    ax.set_ylim(min(max(r["wire"], 1.0) for r in rows) / 3, top * 12)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:g} MB" if v >= 1e6 else f"{v / 1e3:g} kB"))
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["name"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("bytes per step, all processes")
    ax.set_title(title + "\n(labels: counted wire bytes / plain's)", fontsize=10)
    ax.grid(axis="y", alpha=0.3, which="major")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="troupe bench run bytes_per_step --args", description=__doc__.splitlines()[0])
    p.add_argument("--options", nargs="+", default=OPTIONS, choices=OPTIONS)
    p.add_argument("--frameworks", nargs="*", default=list(FRAMEWORKS), choices=list(FRAMEWORKS))
    p.add_argument("--steps", type=int, nargs=2, default=[4, 24], metavar=("A", "B"),
                   help="the two runs' step counts; per step = (B - A) difference (a multiple of 4 suits "
                        "partialUpdate's 4 chunks)")
    p.add_argument("--reps", type=int, default=1, help="pairs of runs per configuration; the median is reported")
    p.add_argument("--batch", type=int, default=64, help="per worker")
    p.add_argument("--topk", type=float, default=0.01, help="spars for sparseTopK")
    p.add_argument("--threshold", type=float, default=1e-3, help="spars for sparseThreshold")
    p.add_argument("--data", choices=["mnist", "synthetic"], default="mnist")
    p.add_argument("--net", choices=["auto", "netns", "loopback"], default="auto",
                   help="auto: simulated hosts when namespaces can be made here, else loopback (no veth column)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="append every pair of runs as troupe bench records (JSON lines)")
    args = p.parse_args(argv)
    a, b = args.steps
    if not 0 <= a < b:
        raise ValueError(f"--steps A B needs 0 <= A < B, got {a} {b}")
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    if "plain" not in args.options:
        raise ValueError("--options must include plain (the dense reference)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from troupe.bench.netns import available
    from troupe.bench.records import checkout_root

    why_not = available()
    if args.net == "netns" and why_not:
        raise ValueError(f"--net netns: network namespaces are not available here ({why_not})")
    if args.net == "auto":
        args.net = "netns" if why_not is None else "loopback"
        if why_not:
            print(f"no veth counters: network namespaces are not available ({why_not}); counters only, on loopback",
                  file=sys.stderr)
    from troupe.bench.records import save, stamp

    started, sink = stamp(checkout_root()), ([] if args.out else None)
    rows = [measure(option, [], 2, option, args, sink) for option in args.options]
    rows += [measure(name, flags, n, "plain", args, sink) for name, (flags, n) in FRAMEWORKS.items()
             if name in args.frameworks]
    if args.out:
        save(args.out, sink, started)
    dense = next(r["wire"] for r in rows if r["name"] == "plain")
    where = "simulated hosts (one network namespace each, veth to a bridge)" if args.net == "netns" else "loopback"
    a, b = args.steps
    print(f"MNIST CNN (431,080 parameters), 2 workers, batch {args.batch}/worker, {args.data} data, {where}; "
          f"per step = (run of {b} steps - run of {a} steps) / {b - a}; bytes of all processes together; "
          f"sparseTopK spars {args.topk}, sparseThreshold spars {args.threshold}\n")
    print(rows_table(rows, dense))
    if args.json:
        Path(args.json).write_text(json.dumps({"net": args.net, "steps": args.steps, "batch": args.batch,
                                               "data": args.data, "rows": rows}, indent=1))
    if args.plot:
        rows_plot(rows, args.plot, f"MNIST CNN, 2 workers: bytes per step ({where.split(' (')[0]})")
    return 0
