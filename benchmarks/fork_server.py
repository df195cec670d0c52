"""CPU and wall time of a small `troupe run` job with and without a fork server (runtime/forkserver.py).

    python benchmarks/fork_server.py [--reps 6]

Starts `troupe fork-server` on a temporary socket, then runs a 2-rank job of
tests/dist/scripts/tiny_train.py alternately served (TROUPE_FORK_SERVER set) and fresh, and
reads the whole machine's busy CPU from /proc/stat around each job (run it on a quiet machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def busy_seconds() -> float:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "troupe.sock")
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TROUPE_FORK_SERVER")}
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        server = subprocess.Popen([sys.executable, "-m", "troupe", "fork-server", sock], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            time.sleep(8)  # its imports
            times: dict[str, list[tuple[float, float]]] = {"served": [], "fresh": []}
            for i in range(args.reps):
                for mode in ("served", "fresh") if i % 2 == 0 else ("fresh", "served"):
                    job_env = {**env, "OMP_NUM_THREADS": "1", **({"TROUPE_FORK_SERVER": sock} if mode == "served" else {})}
                    cpu, wall = busy_seconds(), time.monotonic()
                    subprocess.run([sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--threads", "1",
                                    "tests/dist/scripts/tiny_train.py", tmp], env=job_env, check=True,
                                   capture_output=True, cwd=ROOT)
                    times[mode].append((busy_seconds() - cpu, time.monotonic() - wall))
        finally:
            server.terminate()
            server.wait()
    for mode, runs in times.items():
        print(f"{mode}: CPU s {' '.join(f'{c:.2f}' for c, _ in runs)} (median {statistics.median(c for c, _ in runs):.2f}), "
              f"wall median {statistics.median(w for _, w in runs):.2f} s")


if __name__ == "__main__":
    main()
