"""throughput: samples/s vs number of workers, on loopback and on simulated hosts with shaped links.

    troupe bench run throughput --out results.jsonl --args --workers 1 2 4 --links loopback none 1gbit 100mbit \
        --reps 3 --plot benchmarks/results/throughput.png --json benchmarks/results/throughput.json

Each worker (benchmarks/throughput_job.py) trains the reference MNIST CNN (synthetic 28x28 images, batch 64 per worker,
one thread) with DistOpt for `--steps` measured steps after `--warmup` steps. "loopback"
runs `troupe run -n N` on this machine; the other links put each worker in its own network
namespace on one bridge, with every host's link limited by tc (`troupe.bench.jobs`). Bytes per
step come from the Communicator's counters and, on simulated hosts, from host 0's
interface counters (which also count TCP/IP headers and the rendezvous traffic).
Note: this machine has 2 cores, so more than 2 workers share cores. `--out FILE` appends
every run as troupe bench records (JSON lines; `troupe bench table FILE`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from troupe.bench.jobs import run_job
from troupe.bench.suites.generic import plot, table  # noqa: F401  (the registry renders records with them)

JOB = "benchmarks/throughput_job.py"


def _result(out: str) -> dict:
    for line in out.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no result in output:\n{out[-2000:]}")


def run_once(n: int, link: str, args: argparse.Namespace) -> dict:
    """One job of `n` workers on `link` ("loopback", or simulated hosts: "none" or a tc rate)."""
    job_args = [JOB, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    hosts = None if link == "loopback" else link
    job = run_job(job_args, n, link=hosts, delay=args.delay, timeout=600 if hosts is None else 900).check(1500)
    result = _result(job.stdout)
    if hosts is not None:
        result["iface_bytes_per_step"] = job.tx_bytes[0] / (args.steps + args.warmup)
    return result


def link_beta(link: str, loopback_beta: float) -> float:
    """Seconds per byte of a link: the fitted loopback beta, or the tc rate (whichever is slower)."""
    if link in ("loopback", "none"):
        return loopback_beta
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    number = next(u for u in units if link.endswith(u))
    return max(loopback_beta, 8 / (float(link[: -len(number)]) * units[number]))


def predict_step(one_worker_step: float, wire_bytes: float, alpha: float, beta: float, buckets: int = 1) -> float:
    """Alpha-beta model, no overlap credited: compute of one worker + each bucket's latency + bytes * beta."""
    return one_worker_step + buckets * alpha + wire_bytes * beta


def load_cost_model(path: str) -> dict:
    """alpha and beta fitted to the flat all-reduce medians of collectives records (or read from old JSON)."""
    try:
        old = json.loads(Path(path).read_text())
        if isinstance(old, dict) and "alpha_s" in old:
            return old  # the summary the old benchmarks/collectives.py --json wrote (benchmarks/results/collectives.json)
    except json.JSONDecodeError:
        pass  # several lines: records
    import statistics as st

    from troupe.bench.records import read
    from troupe.bench.suites.collectives import FLAT, fit_alpha_beta

    flat = [r for r in read(path) if r.benchmark == "collectives" and r.contestant == FLAT and r.metric == "step_time"]
    sizes = sorted({r.params["bytes"] for r in flat})
    medians = [st.median(r.value for r in flat if r.params["bytes"] == s) for s in sizes]
    alpha, beta = fit_alpha_beta(sizes, medians)
    return {"alpha_s": alpha, "beta_s_per_byte": beta}


def print_predictions(summary: dict, model: dict) -> None:
    alpha, beta = model["alpha_s"], model["beta_s_per_byte"]
    print(f"\nalpha-beta model (alpha {alpha * 1e6:.0f} us, loopback beta {beta * 1e9:.2f} ns/B from the collectives "
          "benchmark):")
    print("| link | workers | predicted step | measured step | measured / predicted |")
    print("| --- | --- | --- | --- | --- |")
    for link, by_n in summary.items():
        base = by_n.get(1) or by_n.get("1")
        for n, r in sorted(by_n.items(), key=lambda kv: int(kv[0])):
            if int(n) == 1 or base is None:
                continue
            predicted = predict_step(base["step_s"], r["bytes_per_step"], alpha, link_beta(link, beta))
            print(f"| {link} | {n} | {predicted * 1e3:.1f} ms | {r['step_s'] * 1e3:.1f} ms "
                  f"| {r['step_s'] / predicted:.2f} |")


def save_records(path: str, table: dict[str, dict[int, list[dict]]], args: argparse.Namespace, started) -> None:
    """Every run as troupe bench records: contestant = link, world_size = workers."""
    from troupe.bench.records import Record, save

    metrics = [("samples_per_s", "samples/s"), ("step_s", "s"), ("bytes_per_step", "B"), ("iface_bytes_per_step", "B")]
    params = {"batch": args.batch, "steps": args.steps, "warmup": args.warmup, "delay": args.delay}
    out = [Record(benchmark="throughput", contestant=link, workload="cnn", params=params, world_size=n, rep=rep,
                  metric={"step_s": "step_time", "bytes_per_step": "wire_bytes"}.get(key, key), value=r[key], unit=unit)
           for link, by_n in table.items() for n, runs in by_n.items() for rep, r in enumerate(runs)
           for key, unit in metrics if key in r]
    save(path, out, started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="troupe bench run throughput --args", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--links", nargs="+", default=["loopback", "none", "1gbit", "100mbit"])
    p.add_argument("--delay", default=None, help="added one-way latency on simulated links, e.g. 1ms")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="append every run as troupe bench records (JSON lines)")
    p.add_argument("--cost-model", default=None,
                   help="`troupe bench run collectives --out` records (or an old collectives.py --json file): "
                        "print predicted step times")
    args = p.parse_args(argv)
    from troupe.bench.netns import available
    from troupe.bench.records import stamp
    from troupe.bench.records import checkout_root

    started = stamp(checkout_root())
    why_not = available()
    links = [link for link in args.links if link == "loopback" or why_not is None]
    if len(links) < len(args.links):
        print(f"skipping simulated hosts: {why_not}", file=sys.stderr)
    runs: dict[str, dict[int, list[dict]]] = {link: {} for link in links}
    for rep in range(args.reps):  # repetitions interleave every configuration
        single = run_once(1, "loopback", args) if 1 in args.workers else None  # one worker sends nothing: any link
        for link in links:
            for n in args.workers:
                r = single if n == 1 else run_once(n, link, args)
                runs[link].setdefault(n, []).append(r)
                print(f"rep {rep} {link:>8} n={n}: {r['samples_per_s']:.0f} samples/s", file=sys.stderr, flush=True)
    print(f"MNIST CNN, batch {args.batch}/worker, {args.steps} steps after {args.warmup} warm-up, "
          f"median of {args.reps}\n")
    print("| link | workers | samples/s (min-max) | speed-up vs 1 | step time | bytes/step (counters) | bytes/step (interface) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for link in links:
        base = None
        for n in args.workers:
            rs = runs[link][n]
            rate = statistics.median(r["samples_per_s"] for r in rs)
            base = base or rate
            step = statistics.median(r["step_s"] for r in rs)
            counted = statistics.median(r["bytes_per_step"] for r in rs)
            iface = [r["iface_bytes_per_step"] for r in rs if "iface_bytes_per_step" in r]
            iface_s = f"{statistics.median(iface) / 1e6:.2f} MB" if iface else "-"
            lo, hi = min(r["samples_per_s"] for r in rs), max(r["samples_per_s"] for r in rs)
            print(f"| {link} | {n} | {rate:.0f} ({lo:.0f}-{hi:.0f}) | {rate / base:.2f} | {step * 1e3:.1f} ms "
                  f"| {counted / 1e6:.2f} MB | {iface_s} |")
            summary.setdefault(link, {})[n] = {"samples_per_s": rate, "step_s": step, "bytes_per_step": counted}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.out:
        save_records(args.out, runs, args, started)
    if args.cost_model:
        print_predictions(summary, load_cost_model(args.cost_model))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for link in links:
            ns = sorted(summary[link])
            ax.plot(ns, [summary[link][n]["samples_per_s"] for n in ns], marker="o", label=link)
        ax.set_xlabel("workers (processes, 1 thread each; the machine has 2 cores)")
        ax.set_ylabel("samples / s")
        ax.set_xticks(args.workers)
        ax.set_title("MNIST CNN throughput with troupe DistOpt")
        ax.grid(alpha=0.3)
        ax.legend(title="link")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0
