"""An elastic job on two simulated hosts, one `troupe run` launcher each (root; network namespaces).

    sudo python benchmarks/elastic_nodes.py OUT

Host 0's launcher keeps the quorum, host 1's tells it what it sees of its own ranks. Each runs
2 ranks of tests/dist/scripts/elastic_train.py in its `nodes-kill` mode: rank 3 (host 1) SIGKILLs
itself at step 6 and is restarted by host 1's launcher; once it is back rank 0 (host 0) fails and
is restarted by host 0's. GLOO_SOCKET_IFNAME is left unset: troupe picks each rank's interface
towards host 0. Prints both launchers' exit codes and lines, and what each rank reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from troupe.bench import netns

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist" / "scripts" / "elastic_train.py"


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    with netns.Hosts(2, rate="1gbit") as hosts:
        master, start, procs = f"{hosts.addr(0)}:29500", time.monotonic(), []
        for node in (0, 1):
            cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--nnodes", "2", "--node-rank", str(node),
                   "--master", master, "--token", "elastic-nodes", "--elastic", str(SCRIPT), str(out), "nodes-kill"]
            with open(out / f"node{node}.txt", "w") as err:
                procs.append(subprocess.Popen(["ip", "netns", "exec", hosts.names[node], *cmd], cwd=ROOT, env=env,
                                              stdout=subprocess.DEVNULL, stderr=err))
        codes = [p.wait(timeout=300) for p in procs]
        print(f"launchers exited {codes} after {time.monotonic() - start:.1f}s")
    for node in (0, 1):
        print(f"--- host {node}'s launcher\n" + (out / f"node{node}.txt").read_text())
    runs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    print(f"incarnations {[r['incarnation'] for r in runs]}, restarts in a warm spare "
          f"{[r['warm'] for r in runs]}, bit-identical {len({r['sha256'] for r in runs}) == 1}, "
          f"last step's groups {runs[1]['log'][-1][2]}")
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
