"""fault_detection: time to detection for each injected fault (the table in docs/reliability.md, "Faults and what happens").

    troupe bench run fault_detection --args --reps 3

(`troupe bench faults` is the other fault benchmark: network faults on simulated hosts.)

Each fault is injected on rank 1 at step 5 of a 2-rank job started with the Ticket +
multiprocessing pattern (no supervisor, so detection is troupe's own, not `troupe run`'s).
Detection time = when the surviving rank 0 exited minus when rank 1 misbehaved. `--out
FILE` appends every run as troupe bench records (JSON lines; `troupe bench table FILE`).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

from troupe.bench.suites.generic import plot, table  # noqa: F401  (the registry renders records with them)
from troupe.bench.records import checkout_root

SCRIPT = "tests/dist/scripts/fault_train.py"
"""The job (relative to the checkout): 2 ranks by the Ticket + multiprocessing pattern, a fault on rank 1."""
MODES = {
    "kill": "SIGKILL rank 1",
    "raise": "exception in rank 1",
    "stop": "SIGSTOP rank 1 (alive, silent)",
    "hang": "rank 1 sleeps (hung Python code)",
    "nan": "NaN in rank 1's batch",
}


def run_once(mode: str, env: dict[str, str]) -> tuple[float | None, str]:
    proc = subprocess.run([sys.executable, SCRIPT, mode, "--ticket", "2"], capture_output=True, text=True,
                          env=env, timeout=180, cwd=checkout_root())
    out = proc.stdout + proc.stderr
    fault = re.search(r"FAULT \S+ at ([0-9.]+)", out)
    exit0 = re.search(r"EXIT rank 0 code (-?\d+) at ([0-9.]+)", out)
    if not fault or not exit0:
        return None, out
    line = next((m for m in re.findall(r"(PeerFailure: .*|troupe: rank 0 stopping.*|FloatingPointError: rank 0.*)", out)), "")
    return float(exit0.group(2)) - float(fault.group(1)), line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="troupe bench run fault_detection --args", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", default="20", help="TROUPE_TIMEOUT (collective timeout, s)")
    p.add_argument("--peer-timeout", default="15", help="TROUPE_PEER_TIMEOUT (s)")
    p.add_argument("--stall", default="5", help="TROUPE_STALL_SECONDS (s)")
    p.add_argument("--out", default=None, help="append every run as troupe bench records (JSON lines)")
    args = p.parse_args(argv)
    from troupe.bench.records import Record, save, stamp

    started = stamp(checkout_root())
    params = {"timeout": args.timeout, "peer_timeout": args.peer_timeout, "stall": args.stall}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TROUPE_TIMEOUT": args.timeout,
           "TROUPE_PEER_TIMEOUT": args.peer_timeout, "TROUPE_STALL_SECONDS": args.stall}
    print(f"TROUPE_TIMEOUT={args.timeout}s TROUPE_PEER_TIMEOUT={args.peer_timeout}s "
          f"TROUPE_STALL_SECONDS={args.stall}s, {args.reps} runs each\n")
    print("| fault | detected after (median, min-max) | rank 0 reports |")
    print("| --- | --- | --- |")
    for mode, what in MODES.items():
        times, message = [], ""
        for rep in range(args.reps):
            t, message = run_once(mode, env)
            if t is not None:
                times.append(t)
            if args.out:  # not detected: value None
                save(args.out, [Record(benchmark="faults", contestant=what, workload="8-16-4 MLP", params=params,
                                       world_size=2, rep=rep, metric="detect_time", value=t, unit="s")], started)
        shown = (f"{statistics.median(times):.1f}s ({min(times):.1f}-{max(times):.1f})" if times else "not detected")
        message = re.sub(r"\[backend: .*", "[backend error]", message)[:160]
        print(f"| {what} | {shown} | `{message}` |", flush=True)
    return 0
