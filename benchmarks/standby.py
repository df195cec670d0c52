"""The standby launcher, measured: node 0's `troupe run --elastic` SIGKILLed mid-run, node 1's takes over.

    python benchmarks/standby.py OUT [--repeats 3] [--netns]

Three measures, printed and written to OUT/standby.json:

1. **Takeover** (`--repeats` jobs): 2 nodes of 2 processes (loopback, or two simulated hosts with `--netns`, root),
   `--min-groups 2`; every rank logs the wall time of each committed step and who took it. Node 0's launcher is
   SIGKILLed once the job has stepped for 8 s; reported: seconds from the kill to the survivors' first committed
   step, and the step rate before and after.
2. **What the standby costs a step**: the same job without a kill, with a standby (`--min-groups 2`) and without
   one (`--min-groups 3`: the other node's 2 groups could not go on alone), alternating, `--repeats` each: the
   median seconds per step over steps 20-119 on rank 2.
3. **One mirrored read**: in one process, a round's decision read from node 0's store alone, against read and
   copied to the standby's (`Failover.mirror`, what a member does once per store-voted round), alternating, 11
   repetitions of 500 reads each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = """
import json, os, sys, time
import torch
import troupe

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.01))
troupe.track(model=model, optimizer=opt)
membership = opt.world.membership
out, steps = sys.argv[1], int(sys.argv[2])
log = []
while opt.step_count < steps:
    opt.zero_grad()
    x = torch.randn(16, 32)
    torch.nn.functional.mse_loss(model(x), x[:, :1]).backward()
    opt.step()
    log.append([time.time(), opt.step_count, list(membership.stepped_with or [])])
    if len(log) % 20 == 0 or opt.step_count >= steps:
        with open(os.path.join(out, "steps%s.json" % os.environ["RANK"]), "w") as f:
            json.dump(log, f)
    time.sleep(0.01)
"""


def job(out: Path, min_groups: int, steps: int, kill_after: float | None, hosts=None) -> dict:
    """One 2-node job; with `kill_after`, node 0's launcher SIGKILLed that many seconds after rank 2's first step."""
    from troupe.runtime.ticket import free_port

    out.mkdir(parents=True, exist_ok=True)
    script = out / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    master = f"{hosts.addr(0)}:29500" if hosts else f"127.0.0.1:{free_port('127.0.0.1')}"
    procs, errs = [], []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--nnodes", "2", "--node-rank", str(node),
               "--master", master, "--token", "standby-bench", "--elastic", "--min-groups", str(min_groups),
               str(script), str(out), str(steps)]
        if hosts:
            cmd = ["ip", "netns", "exec", hosts.names[node], *cmd]
        errs.append(open(out / f"node{node}.txt", "w"))  # noqa: SIM115  (closed below)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=errs[-1]))
    killed = None
    try:
        if kill_after is not None:
            deadline = time.monotonic() + 120
            while not (out / "steps2.json").exists():
                assert time.monotonic() < deadline and procs[1].poll() is None, "the job never stepped"
                time.sleep(0.05)
            time.sleep(kill_after)
            procs[0].kill()
            killed = time.time()
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in errs:
            f.close()
    log = json.loads((out / "steps2.json").read_text())
    result = {"codes": codes, "steps": log[-1][1]}
    if killed is not None:
        before = [t for t, _, m in log if t < killed and m == [0, 1, 2, 3]]
        after = [t for t, _, m in log if t > killed and m == [2, 3]]
        result.update(resumed_s=after[0] - killed, before_steps_per_s=(len(before) - 1) / (before[-1] - before[0]),
                      after_steps_per_s=(len(after) - 1) / (after[-1] - after[0]))
    else:
        times = [t for t, _, _ in log][20:120]
        result["s_per_step"] = statistics.median(b - a for a, b in zip(times, times[1:]))
    return result


def mirrored_read(reps: int = 11, reads: int = 500) -> dict:
    import torch.distributed as dist

    from troupe.runtime.failover import STANDBY_KEY, Failover
    from troupe.runtime.ticket import free_port

    td = datetime.timedelta(seconds=10)
    ports = [free_port("127.0.0.1") for _ in range(2)]
    servers = [dist.TCPStore("127.0.0.1", p, is_master=True, timeout=td, wait_for_workers=False) for p in ports]
    opened = lambda host, port, timeout: dist.TCPStore(host, port, is_master=False,  # noqa: E731
                                                       timeout=datetime.timedelta(seconds=timeout))
    plain = Failover(("127.0.0.1", ports[0]), opened).connect(10.0)
    failover = Failover(("127.0.0.1", ports[0]), opened)
    mirrored = failover.connect(10.0)
    servers[0].set(STANDBY_KEY, f"127.0.0.1:{ports[1]}")
    failover.learn(mirrored)
    for k in range(reads):
        servers[0].set(f"q1/r{k}/d", "x" * 200)
    times = {"alone": [], "mirrored": []}
    for rep in range(reps):
        for name in (("alone", "mirrored") if rep % 2 == 0 else ("mirrored", "alone")):
            store = plain if name == "alone" else mirrored
            t = time.perf_counter()
            for k in range(reads):
                store.get(f"q1/r{k}/d")
            times[name].append((time.perf_counter() - t) / reads * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--netns", action="store_true", help="two simulated hosts (root)")
    args = parser.parse_args()
    hosts = None
    if args.netns:
        from troupe.bench import netns

        hosts = netns.Hosts(2, rate="1gbit").__enter__()
    try:
        results: dict = {"mirrored_read_us": mirrored_read()}
        print("one decision read (us, median of 11 x 500):", results["mirrored_read_us"], flush=True)
        results["takeover"] = []
        for i in range(args.repeats):
            r = job(args.out / f"kill{i}", 2, 600, kill_after=8.0, hosts=hosts)
            results["takeover"].append(r)
            print("takeover:", r, flush=True)
        results["cost"] = {"standby": [], "none": []}
        for i in range(args.repeats):
            for name, min_groups in ((("standby", 2), ("none", 3)) if i % 2 == 0 else (("none", 3), ("standby", 2))):
                r = job(args.out / f"{name}{i}", min_groups, 140, kill_after=None, hosts=hosts)
                results["cost"][name].append(r["s_per_step"])
                print(name, r, flush=True)
    finally:
        if hosts is not None:
            hosts.__exit__(None, None, None)
    (args.out / "standby.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
