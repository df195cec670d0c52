"""DiLoCo over sharded worker groups (``--shard optimizer``) beside unsharded DiLoCo and plain all-reduce.

    python benchmarks/diloco_shard.py --out benchmarks/results/diloco_shard.jsonl      # needs root (netns)

Two measurements, the same three contestants (8 processes, 4 worker groups of 2 for DiLoCo, H = 50):

1. Bytes and state, on loopback: ``troupe run -n 8 <flags> benchmarks/diloco_shard.py count`` trains the
   example's MNIST CNN (431,080 parameters) for 2 outer periods of H = 2 steps on random batches; each
   process reports the bytes its place communicator (across groups) and its group communicator (inside
   the group) counted in the step that ends in an outer step, less those of a step that does not (the
   inner all-reduce), the bytes of outer state it holds (`DiLoCo.outer_bytes`: theta_outer and the outer
   momentum) and its peak resident set (VmHWM).
2. Time to 98.5 % test accuracy on 4 simulated hosts (`troupe.bench.netns.Hosts`, tc-shaped links at
   ``--link``, default 100mbit): host i runs ``troupe run -n 2 --nnodes 4 --node-rank i`` of
   benchmarks/time_to_accuracy.py (the CNN, SGD lr 0.05, batch 64 per process), so each DiLoCo group
   is one host (its inner all-reduce on the host's loopback) and only the place exchange crosses the
   links, INTELLECT-1's layout. Rank 0's time to the target and final accuracy; the bytes each host's
   interface sent, divided by its 2 processes and the outer steps taken (everything that left the host:
   the outer exchanges, the evaluations' reductions, TCP headers).

One run per contestant, one after the other (a shared 2-core machine: the seconds are one sample each).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "DILOCO_SHARD "
H = 50
CONTESTANTS: dict[str, list[str]] = {
    "plain": [],
    "diloco": ["--framework", "diloco", "--nworker-groups", "4", "--sync-freq", str(H)],
    "diloco --shard optimizer": ["--framework", "diloco", "--nworker-groups", "4", "--sync-freq", str(H),
                                 "--shard", "optimizer"],
}
"""troupe run flags of each contestant (8 processes)."""


def count() -> None:
    """One process of the loopback job: bytes of an outer step against an inner one, outer state, peak RSS."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_cnn import CNN

    import troupe

    torch.manual_seed(0)
    model = CNN()
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    s = opt.strategy
    comms = {"place": getattr(s, "place", None), "group": getattr(getattr(s, "inner", None), "comm", None)}
    comms = {k: c for k, c in comms.items() if c is not None} or {"world": troupe.init().comm}
    g = torch.Generator().manual_seed(opt.global_rank)
    per_step = []
    for _ in range(4):  # H = 2 under DiLoCo: steps 2 and 4 end in an outer step
        before = {k: c.bytes_sent() for k, c in comms.items()}
        x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        per_step.append({k: c.bytes_sent() - before[k] for k, c in comms.items()})
    outer = {k: per_step[3][k] - per_step[2][k] for k in comms}  # step 4 (outer) less step 3 (inner only)
    hwm = int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024
    line = {"rank": opt.global_rank, "inner_step": per_step[2], "outer_step_extra": outer,
            "outer_state_bytes": s.outer_bytes() if hasattr(s, "outer_bytes") else 0, "vmhwm": hwm,
            "params": sum(p.numel() for p in model.parameters())}
    os.write(sys.stdout.fileno(), (MARK + json.dumps(line) + "\n").encode())


def measure_bytes(flags: list[str]) -> list[dict]:
    """The loopback job's per-process reports, rank order."""
    fast = [f if f != str(H) else "2" for f in flags]
    cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", "8", "--threads", "1", *fast, __file__, "count"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return sorted((json.loads(m) for m in re.findall(rf"^{MARK}(.*)$", done.stdout, re.M)), key=lambda r: r["rank"])


def time_to_accuracy(name: str, flags: list[str], link: str, epochs: int, timeout: float) -> dict:
    """One contestant on 4 simulated hosts, 2 processes (one DiLoCo group) each: rank 0's result, host bytes."""
    from troupe.bench.netns import Hosts

    job = ["benchmarks/time_to_accuracy.py", "--lr", "0.05", "--epochs", str(epochs), "--eval-every", str(H),
           "--name", name, *(["--period", str(H)] if flags else [])]
    token, port = secrets.token_hex(8), 29700 + secrets.randbelow(200)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with Hosts(4, rate=link) as hosts:
        before = [hosts.tx_bytes(i) for i in range(4)]
        procs = [hosts.popen(i, [sys.executable, "-m", "troupe.cli", "run", "--threads", "1", "-n", "2", "--nnodes",
                                 "4", "--node-rank", str(i), "--master", f"{hosts.addr(0)}:{port}", "--token", token,
                                 *flags, *job], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT) for i in range(4)]
        try:
            outs = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        tx = [hosts.tx_bytes(i) - before[i] for i in range(4)]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: a host failed:\n" + "\n".join(e[-2000:] for _, e in outs))
    result = json.loads([line for line in outs[0][0].splitlines() if line.startswith("{")][-1])
    return {**result, "host_tx_bytes": tx}


def table(rows: list[dict]) -> str:
    """Markdown: one line per contestant, the counts of its first row, the seconds of every run of it (in order)."""
    runs: dict[str, list[dict]] = {}
    for r in rows:
        runs.setdefault(r["contestant"], []).append(r)
    if not {"plain", "diloco"} <= set(runs):
        return "(the table needs a plain and a diloco row)"
    b = runs["diloco"][0]["count"]
    b_across = max(p["outer_step_extra"]["place"] for p in b)
    b_state = max(p["outer_state_bytes"] for p in b)
    plain_s = runs["plain"][0]["tta"]["seconds_to_target"]
    lines = ["| contestant | across groups per outer step, per process (count) | / unsharded | inside the group "
             "per outer step, per process | outer state per process | / unsharded | peak RSS per process (max) | "
             "left each host per outer step, per process (tc link) | s to 98.5 % (each run) | / plain | "
             "steps to 98.5 % | final accuracy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rs in runs.items():
        c, t = rs[0]["count"], rs[0]["tta"]
        rss = f"{max(p['vmhwm'] for p in c) / 2**20:.0f} MiB"
        seconds = [r["tta"]["seconds_to_target"] for r in rs]
        shown = " / ".join(f"{x:.1f}" if x else "not reached" for x in seconds)
        ratio = " / ".join(f"{x / plain_s:.2f}" if x and plain_s else "–" for x in seconds)
        steps = " / ".join(str(r["tta"]["steps_to_target"]) for r in rs)
        final = " / ".join(f"{r['tta']['final_acc']:.4f}" for r in rs)
        if name == "plain":
            host = f"{sum(t['host_tx_bytes']) / 8 / t['steps']:,.0f} per step"
            lines.append(f"| plain | {max(p['inner_step']['world'] for p in c):,} per step | – | – | 0 | – | {rss} | "
                         f"{host} | {shown} | {ratio} | {steps} | {final} |")
            continue
        across = max(p["outer_step_extra"]["place"] for p in c)
        inside = max(p["outer_step_extra"]["group"] for p in c)
        state = max(p["outer_state_bytes"] for p in c)
        host = " / ".join(f"{sum(r['tta']['host_tx_bytes']) / 8 / (r['tta']['steps'] // H):,.0f}" for r in rs)
        lines.append(f"| {name} | {across:,} | {across / b_across:.3f} | {inside:,} | {state:,} | {state / b_state:.3f} "
                     f"| {rss} | {host} | {shown} | {ratio} | {steps} | {final} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["count"]:
        return count()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="100mbit", help="tc rate of each simulated host's link")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds one contestant's job may take")
    p.add_argument("--only", nargs="+", default=None, choices=sorted(CONTESTANTS),
                   help="these contestants only, in this order (the table compares with plain and diloco)")
    p.add_argument("--out", default=None, help="append every row as a JSON line")
    p.add_argument("--table", default=None, metavar="FILE", help="only print the table of the rows in FILE")
    args = p.parse_args(argv)
    if args.table:
        print(table([json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()]))
        return None
    rows = []
    for name in args.only or CONTESTANTS:
        flags = CONTESTANTS[name]
        start = time.time()
        row = {"contestant": name, "flags": " ".join(flags), "count": measure_bytes(flags),
               "tta": time_to_accuracy(name, flags, args.link, args.epochs, args.timeout), "link": args.link,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start))}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
