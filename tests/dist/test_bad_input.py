"""Bad input gets one readable error and a non-zero exit, never a hang."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.dist.world import RankFailed, run_world

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TROUPE_JOIN_TIMEOUT": "4", "TROUPE_TIMEOUT": "20"}


def spawn(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**ENV, **(env or {})}, cwd=ROOT,
    )


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


JOIN = """
import sys, troupe
addr, port, token, rank, world = sys.argv[1:6]
troupe.init(troupe.Ticket(addr=addr, port=int(port), token=token), int(rank), int(world))
print("joined")
"""


def test_wrong_token_is_refused_and_rank0_names_the_missing_rank():
    import troupe

    t = troupe.Ticket()
    start = time.monotonic()
    good = spawn(JOIN, t.addr, str(t.port), t.token, "0", "2")
    time.sleep(1.0)
    bad = spawn(JOIN, t.addr, str(t.port), "not-the-token", "1", "2")
    code_bad, out_bad = finish(bad)
    code_good, out_good = finish(good)
    assert code_bad != 0 and "wrong ticket token" in out_bad
    assert code_good != 0 and "missing ranks [1]" in out_good
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_world_size_larger_than_processes_started():
    import troupe

    t = troupe.Ticket()
    # long enough for both processes to start (importing torch takes seconds on a loaded machine)
    procs = [spawn(JOIN, t.addr, str(t.port), t.token, str(r), "3", env={"TROUPE_JOIN_TIMEOUT": "15"}) for r in range(2)]
    for p in procs:
        code, out = finish(p)
        assert code != 0 and "missing ranks [2]" in out and "world_size=3" in out


BAD_CALLS = [
    ("troupe.init(troupe.Ticket(), 2, 2)", "rank 2 is out of range for world_size 2"),
    ("troupe.init(troupe.Ticket(), -1, 2)", "out of range"),
    ("troupe.init(None, 0, 2)", "without a ticket"),
    ("troupe.init(backend='nccl')", "needs a CUDA GPU"),
    ("troupe.init(backend='mpi')", "backend must be 'gloo' or 'nccl'"),
    ("troupe.Ticket(port=70000)", "port must be an int"),
    ("troupe.Ticket.decode('nonsense')", "malformed ticket"),
    ("troupe.DistOpt(object())", "wraps a torch.optim.Optimizer"),
    ("troupe.data.partition(list(range(3)), list(range(3)), 0, 4)", "smaller than world_size 4"),
]

CALL_EACH = """
import sys, traceback, troupe
for i, call in enumerate(sys.argv[1:]):
    sys.stderr.flush()
    print(f"=== {i}", flush=True)
    try:
        exec(call)
    except BaseException:  # SystemExit too: printed as an uncaught one would be, and on to the next call
        traceback.print_exc()
        sys.stderr.flush()
        print(f"=== {i} raised", flush=True)
    else:
        print(f"=== {i} returned", flush=True)
"""


@pytest.fixture(scope="module")
def bad_calls() -> list[str]:
    """Each call's output in one fresh interpreter (one start of torch, not nine; every call fails before it
    changes anything, so they do not see each other), stderr merged into stdout in order."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CALL_EACH), *[call for call, _ in BAD_CALLS]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=ROOT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return [out.split(f"=== {i}\n")[1].split(f"=== {i + 1}\n")[0] for i in range(len(BAD_CALLS))]


@pytest.mark.parametrize("case", range(len(BAD_CALLS)), ids=[call for call, _ in BAD_CALLS])
def test_bad_arguments_raise_clear_errors(bad_calls, case):
    call, message = BAD_CALLS[case]
    out = bad_calls[case]
    assert f"=== {case} raised" in out and message in out, (call, out)


def test_port_already_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        code, out = finish(spawn(f"import troupe\ntroupe.init(troupe.Ticket(port={port}), 0, 2)"))
    assert code != 0 and f"cannot listen on 127.0.0.1:{port}" in out and "already in use" in out


def _mismatched_model(rank, world_size):
    import torch

    import troupe

    model = torch.nn.Linear(4, 3 + rank)
    troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1))


def test_model_differs_across_ranks():
    with pytest.raises(RankFailed, match="differs across ranks"):
        run_world(_mismatched_model, 2, timeout=60)


FAIL_ON_RANK_1 = """
import os, time, torch, troupe
info = troupe.init()
if info.global_rank == 1:
    raise SystemExit("rank 1 gives up")
time.sleep(120)  # rank 0 would wait forever without troupe run stopping it
"""


def test_troupe_run_stops_all_ranks_when_one_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_RANK_1)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "troupe.cli", "run", "-n", "2", str(script)],
        capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "rank 1 exited with code 1; stopped the other ranks" in proc.stderr
    assert time.monotonic() - start < 30


def test_troupe_run_rejects_bad_arguments(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "troupe.cli", *args], capture_output=True, text=True, timeout=30)

    assert "script not found" in cli("run", "-n", "2", "nope.py").stderr
    script = tmp_path / "x.py"
    script.write_text("")
    assert "out of range" in cli("run", "--nnodes", "2", "--node-rank", "2", str(script)).stderr
    assert "--token" in cli("run", "--nnodes", "2", "--master", "127.0.0.1:1234", str(script)).stderr
    assert "must be >= 1" in cli("run", "-n", "0", str(script)).stderr


def _held_after_a_free_port() -> socket.socket:
    """A listening socket on a port p + 1 whose port p is free now (any port the OS hands out may have its
    predecessor taken by another test's server: then the launcher said that one was in use instead)."""
    for _ in range(100):
        held = socket.create_server(("127.0.0.1", 0))
        try:
            socket.create_server(("127.0.0.1", held.getsockname()[1] - 1)).close()
            return held
        except OSError:
            held.close()
    raise RuntimeError("no port p + 1 with p free in 100 tries")


def test_troupe_run_refuses_bad_paths_ports_and_job_files_in_one_line(tmp_path):
    """Every case at once (the launcher checks them before any rank starts: no torch, no rank)."""
    script = tmp_path / "x.py"
    script.write_text("")
    (tmp_path / "adir").mkdir()
    (tmp_path / "unknown.conf").write_text('cluster {\n  framework: "nope"\n  nworker_groups: 2\n}\n')
    (tmp_path / "broken.conf").write_text("cluster {\n  nworker_groups: 2\n")
    listening = [socket.create_server(("127.0.0.1", 0)), _held_after_a_free_port()]
    taken, next_taken = (s.getsockname()[1] for s in listening)
    cases = {
        ("-n", "4", "--cluster", "/nonexistent.conf", str(script)): "cannot read the cluster file /nonexistent.conf",
        ("--cluster", str(tmp_path / "adir"), str(script)): "cannot read the cluster file",
        ("--cluster", str(tmp_path / "unknown.conf"), str(script)): "unknown.conf: framework must be one of",
        ("--cluster", str(tmp_path / "broken.conf"), str(script)): "broken.conf: line 1",
        (str(tmp_path / "adir"),): "is not a file",
        ("--checkpoint-dir", "/proc/nope/ckpt", str(script)): "--checkpoint-dir /proc/nope/ckpt: cannot make",
        ("--checkpoint-dir", str(script), str(script)): "not a directory",
        ("--resume", "/nonexistent", str(script)): "--resume: no such directory",
        ("--log-dir", "/proc/nope", str(script)): "--log-dir /proc/nope: cannot make",
        ("--stats", "/nonexistent/s.jsonl", str(script)): "--stats /nonexistent/s.jsonl: its directory",
        ("--master", f"127.0.0.1:{taken}", str(script)): f"port {taken}, for its rendezvous, is in use",
        ("--master", f"127.0.0.1:{next_taken - 1}", str(script)): f"port {next_taken}, for the script's env://",
        ("--master", "127.0.0.1:65535", str(script)): "--master's port must be in 1..65534",  # argparse's, one line
    }
    try:
        procs = {args: subprocess.Popen([sys.executable, "-m", "troupe.cli", "run", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
                 for args in cases}
        for args, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"troupe run {args} ran past 30 s") from None
            assert proc.returncode == 2, (args, proc.returncode, err)
            assert err.startswith("troupe run: ") and err.count("\n") == 1 and cases[args] in err, (args, err)
    finally:
        for s in listening:
            s.close()
