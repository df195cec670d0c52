"""Scripts not written for troupe, under troupe's regimes (issue 47's conformance matrix, the cells that broke).

A script that makes and destroys its own process group (examples/ddp_tutorial.py) under the parameter-server
frameworks: the servers meet the workers in the script's group, and troupe's last work (a worker's goodbye
to its servers, the final master-copy sync) runs before the script's ``destroy_process_group()`` takes
troupe's groups. What troupe fails to do at exit fails the process. A script without ``troupe.track``
under ``--elastic`` joins and heals at its model's first forward."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "ddp_tutorial.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60"}


def troupe_run(cwd: Path, *args: str) -> subprocess.Popen:
    cwd.mkdir()
    cmd = [sys.executable, "-m", "troupe.cli", "run", "--threads", "1", *args,
           str(SCRIPT), "1", "1", "--batch_size", "256"]  # one epoch, 4 (or 8) steps per worker
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=cwd)


def communicate(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} ran past {timeout}s\n{out}\n{err}") from None


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    out, err = communicate(proc, timeout)
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}\n{out}\n{err}"
    assert "Traceback" not in err and "frame #" not in err, err
    return out, err


def test_parameter_servers_and_group_sync_with_the_scripts_own_process_group(tmp_path):
    start = time.monotonic()
    # At once: Downpour (2 workers, 1 separate server) and Distributed Hogwild (2 groups, co-located servers).
    downpour = troupe_run(tmp_path / "downpour", "-n", "3", "--framework", "downpour", "--nworkers-per-group", "1",
                          "--nservers-per-group", "1")
    hogwild = troupe_run(tmp_path / "hogwild", "-n", "2", "--framework", "hogwild")
    out, err = finish(downpour)
    assert "[rank 0] Epoch 0" in out and "[rank 1] Epoch 0" in out, out
    assert "troupe server rank 2:" in err and "slice updates" in err, err
    assert "workers gone without stopping: none" in err, err  # both workers said goodbye before the destroy
    # The script's DistributedSampler counts the server among its replicas: said once, not silent.
    assert err.count("the script's process group has 3 ranks, 1 of them servers, which train on no data") == 1, err
    assert (tmp_path / "downpour" / "snapshot.pt").is_file()
    out, err = finish(hogwild)
    assert "[rank 0] Epoch 0" in out and "[rank 1] Epoch 0" in out, out
    for rank in (0, 1):  # the final master-copy sync ran, before the script's destroy_process_group
        assert f"troupe group sync rank {rank}:" in err, err
    assert time.monotonic() - start < 45


FAILING_LAST_WORK = """
import sys
import torch.distributed as dist
import troupe

world = troupe.init()
def last_work():
    raise RuntimeError("the final sync lost its peer\\nsecond line")
world.on_shutdown(last_work)
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
    print("after destroy", flush=True)
"""


def test_a_failure_of_troupes_last_work_fails_the_process_in_one_line(tmp_path):
    script = tmp_path / "last.py"
    script.write_text(FAILING_LAST_WORK)
    # At once: the script destroys the default group itself (troupe's last work runs there), or leaves it to exit.
    procs = {how: subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=ENV, cwd=tmp_path) for how in ("destroy", "exit")}
    for how, proc in procs.items():
        out, err = communicate(proc)
        assert proc.returncode == 1, (how, proc.returncode, out, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines == ["troupe: rank 0: troupe's last work in the job failed "
                         "(RuntimeError: the final sync lost its peer)"], (how, err)
        assert ("after destroy" in out) == (how == "destroy"), (how, out)


def test_elastic_without_troupe_track_heals_at_the_first_forward(tmp_path):
    # Each process starts from its own random model: they end equal only if the first quorum's heal ran.
    script = ROOT / "tests" / "dist" / "scripts" / "untracked_elastic.py"
    proc = subprocess.Popen([sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--threads", "1", "--elastic",
                             str(script), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=tmp_path)
    finish(proc)
    first, second = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert first["steps"] == second["steps"] >= 12
    for name, value in first["model"].items():
        assert torch.equal(value, second["model"][name]), name


RAISES_BEFORE_ITS_FIRST_STEP = """
import torch, troupe
sgd = troupe.DistOpt(torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1))
raise ValueError("the data has 3 columns, the model wants 4")
"""


def test_elastic_refuses_a_script_with_its_own_group_and_stops_at_a_repeated_early_failure(tmp_path):
    # At once: a script's own init_process_group would leave the job silently not elastic: refused, the job
    # stopped at once (a restart would be refused again, if its init_process_group did not hang first); and a
    # script that raises before its first step in every life: stopped at the first repeat, not after 10 restarts.
    start = time.monotonic()
    own_group = troupe_run(tmp_path / "own", "-n", "2", "--elastic")
    script = tmp_path / "early.py"
    script.write_text(RAISES_BEFORE_ITS_FIRST_STEP)
    early = subprocess.Popen([sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--threads", "1", "--elastic",
                              str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                             cwd=tmp_path)
    for proc, last, lives in ((own_group, "; under troupe run --elastic troupe makes the process groups", 1),
                              (early, " failed again before its first step, the same way (ValueError: the data has "
                                      "3 columns, the model wants 4): not a fault to train through; stopped the job",
                               2)):
        out, err = communicate(proc)
        assert proc.returncode == 1, (out, err)
        line = err.strip().splitlines()[-1]
        assert line.startswith("troupe run: rank ") and last in line, err
        assert ("restart 1 of" in err) == (lives == 2) and "restart 2 of" not in err and "frame #" not in err, err
        if lives == 1:  # troupe's refusal: one line from each rank that got to say it before the launcher
            # stopped the job (the first rank's refusal stops the others: one or both), no traceback
            assert "Traceback" not in err and 1 <= err.count("troupe: rank ") <= 2, err
    assert time.monotonic() - start < 30
