"""`troupe bench faults` leaves nothing behind when it is interrupted mid-run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from troupe.bench import netns

pytestmark = [pytest.mark.netns, pytest.mark.benchmark, pytest.mark.skipif(bool(netns.available()), reason=f"simulated hosts: {netns.available()}")]


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_matrix_removes_its_hosts_and_processes(tmp_path, sig):
    # Each case's own step count, so that it finds its own job's processes, not the other case's
    # (both may run at once on two xdist workers, one waiting for the simulated hosts' lock).
    steps = 400 + int(sig)
    ours = f"faultjob.py --steps {steps} --pace 0.1"
    proc = subprocess.Popen([sys.executable, "-m", "troupe", "bench", "faults", "--regimes", "plain-2", "--faults",
                             "down", "--steps", str(steps), "--pace", "0.1", "--workdir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    # wait until the job trains on the simulated hosts (the lock may first be held by another test)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        running = subprocess.run(["ip", "netns", "pids", "troupe-h1"], capture_output=True, text=True).stdout.split()
        mine = subprocess.run(["pgrep", "-f", ours], capture_output=True, text=True).stdout.split()
        if running and set(running) & set(mine) and "troupe-sw" in namespaces():
            break
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the matrix never started its job")
    time.sleep(3)
    masks = [line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if line.startswith("Sig")]
    proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the matrix did not end within 60 s of signal {sig}; its signal masks {masks}; "
                    f"its output:\n{out[-3000:]}")
    assert proc.returncode != 0
    assert netns.leftover() == [], out[-2000:]
    job = subprocess.run(["pgrep", "-f", ours], capture_output=True, text=True)
    assert job.returncode == 1, f"job processes outlived the harness: {job.stdout}"
