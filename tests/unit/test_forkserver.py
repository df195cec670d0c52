"""`troupe run` launchers forked from a fork server (troupe.runtime.forkserver) behave as launchers started
afresh: the job, its exit status, its output, the signals sent to `troupe run`, a `troupe run` killed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from troupe.runtime.forkserver import ENV_VAR, namespaces, refusal

pytestmark = [pytest.mark.process]

ROOT = Path(__file__).resolve().parents[2]

JOB = """
import os, sys, time
import troupe
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} here", flush=True)
if sys.argv[1] == "sleep":
    with open(os.path.join(sys.argv[2], f"started{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
if rank == 1 and sys.argv[1] == "fail":
    raise SystemExit(3)
"""


def test_a_request_from_another_interpreter_is_refused():
    here = {"executable": sys.executable, "env": dict(os.environ), "namespaces": namespaces(), "uid": os.getuid()}
    assert refusal(here) is None
    assert refusal({**here, "env": {**os.environ, "PYTHONPATH": "/elsewhere", "PYTHONUNBUFFERED": "1"}}) is None
    assert refusal({**here, "executable": "/usr/bin/python2"}) == "another Python (/usr/bin/python2)"
    assert refusal({**here, "env": {**os.environ, "PYTHONWARNINGS": "error"}}) == "another PYTHONWARNINGS"
    assert refusal({**here, "namespaces": {"net": "net:[1]"}}) == "another net namespace (net:[1])"
    assert refusal({**here, "env": {**os.environ, "LD_PRELOAD": "libjemalloc.so"}}) == "another LD_PRELOAD"
    assert refusal({**here, "cgroup": "0::/elsewhere\n"}) == "another cgroup"


def _troupe_run(tmp_path: Path, mode: str, served: bool, env_more: dict[str, str] | None = None,
                **popen) -> subprocess.Popen:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_more or {})}
    if not served:
        env.pop(ENV_VAR, None)
    return subprocess.Popen([sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--threads", "1", str(script), mode,
                             str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def _launchers(fork_server) -> list[int]:
    return [int(pid) for pid in re.findall(r"launcher (\d+) for", fork_server.log.read_text())]


@pytest.mark.timeout(120)
def test_a_served_launcher_runs_the_job_with_a_fresh_one_s_output_and_exit_status(tmp_path, fork_server):
    if fork_server is None:
        pytest.skip("no fork server in this pytest process (TROUPE_TEST_FORK_SERVER=0 was given, or it did not start)")
    results = {}
    for served in (True, False):
        for mode in ("ok", "fail"):
            before = len(_launchers(fork_server))
            proc = _troupe_run(tmp_path, mode, served)
            out, err = proc.communicate(timeout=90)
            results[served, mode] = (proc.returncode, sorted(out.splitlines()), err,
                                     len(_launchers(fork_server)) - before)
    for mode, code in (("ok", 0), ("fail", 3)):
        (rc_s, out_s, err_s, n_s), (rc_f, out_f, err_f, n_f) = results[True, mode], results[False, mode]
        assert (n_s, n_f) == (1, 0), "the served launcher was not forked by the server, or the fresh one was"
        assert rc_s == rc_f == code, (rc_s, rc_f, err_s)
        assert out_s == out_f == ["rank 0 of 2 here", "rank 1 of 2 here"]
        assert err_s.splitlines()[-1:] == err_f.splitlines()[-1:]
    assert "rank 1 exited with code 3" in results[True, "fail"][2]
    # a client the server cannot stand for (another PYTHONWARNINGS) runs its launcher itself, as without a server
    before = fork_server.log.read_text()
    proc = _troupe_run(tmp_path, "ok", True, env_more={"PYTHONWARNINGS": "default"})
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0 and sorted(out.splitlines()) == ["rank 0 of 2 here", "rank 1 of 2 here"], err
    assert fork_server.log.read_text()[len(before):].count("refused") == 1, "the server did not refuse it"


@pytest.mark.timeout(120)
def test_a_served_launcher_gets_the_signals_sent_to_troupe_run_and_dies_with_it(tmp_path, fork_server):
    if fork_server is None:
        pytest.skip("no fork server in this pytest process (TROUPE_TEST_FORK_SERVER=0 was given, or it did not start)")

    def started(n: int = 2) -> list[int]:
        deadline = time.monotonic() + 60
        files = [tmp_path / f"started{r}" for r in range(n)]
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        pids = [int(f.read_text()) for f in files]
        for f in files:
            f.unlink()
        return pids

    codes = []
    for served in (True, False):  # SIGTERM to troupe run: it stops its ranks and ends as a fresh one does
        proc = _troupe_run(tmp_path, "sleep", served)
        started()
        time.sleep(1.0)  # the launcher watches its ranks (and handles SIGTERM) once it has started them all
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        codes.append(proc.returncode)
    assert codes[0] == codes[1] != 0, codes
    # troupe run killed: the server kills its launcher, as if the launcher itself had been killed
    proc = _troupe_run(tmp_path, "sleep", True)
    ranks = started()
    launcher = _launchers(fork_server)[-1]
    proc.kill()
    proc.communicate(timeout=30)
    try:
        deadline = time.monotonic() + 30
        while _state(launcher) != "Z":
            assert time.monotonic() < deadline, "the launcher outlived its troupe run"
            time.sleep(0.05)
    finally:
        for pid in ranks:  # orphans, as a killed launcher's ranks are
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
