"""`troupe bench run ps` runs end to end in a tiny configuration (harness, not timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.benchmark]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ps_benchmark_times_ddp_and_a_parameter_server(tmp_path):
    rows = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "troupe.cli", "bench", "run", "ps", "--args",
           "--contestants", "ddp,downpour", "--steps", "6",
           "--snapshot-every", "3", "--test-size", "1000", "--targets", "0.0,0.999", "--json", str(rows)]
    env = {**os.environ, "TROUPE_JOIN_TIMEOUT": "60", "TROUPE_TIMEOUT": "120"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "| contestant | time to 0.0% (s) | time to 99.9% (s) |" in done.stdout
    got = {r["contestant"]: r for r in map(json.loads, rows.read_text().splitlines())}
    assert sorted(got) == ["ddp", "downpour"]
    for r in got.values():
        assert r["steps_to_0.0"] == 3  # the first snapshot reaches 0%
        assert r["time_to_0.999"] is None  # nothing reaches 99.9% in 6 steps: "not reached"
        assert 0.0 < r["final_acc"] < 1.0 and r["curve"][-1][1] == 6
    assert got["downpour"]["server_updates_per_s"] > 0  # parsed from the server's closing line
    row = next(line for line in done.stdout.splitlines() if line.startswith("| downpour |"))
    assert row.split(" | ")[2] == "not reached"


def test_a_contestant_name_may_carry_its_momentum():
    from troupe.bench.suites import ps
    assert ps.variant("downpour-sum-m0.7") == ("downpour-sum", 0.7)
    assert ps.variant("downpour-bg-mean-inverse") == ("downpour-bg-mean-inverse", 0.9)  # "-m" inside: no suffix
    assert ps.launch_args("downpour-predict-sum-m0.5", 2) == ps.launch_args("downpour-predict-sum", 2)
    assert "--group-merge" in ps.launch_args("downpour-predict-sum", 2)


def test_a_contestant_name_may_carry_its_steps():
    from troupe.bench.suites import ps
    assert ps.variant("downpour-m0.7-s2000") == ("downpour", 0.7) and ps.steps_of("downpour-m0.7-s2000", 1000) == 2000
    assert ps.variant("downpour-sum-s2000") == ("downpour-sum", 0.9)
    assert ps.steps_of("downpour-sum", 1000) == 1000 and ps.steps_of("downpour-sum-m0.5", 7) == 7


def test_the_step_benchmark_times_a_worker_that_sends_during_backward():
    # the CNN has two gradient buckets: from its second step a worker's Updates leave as backward fills them
    cmd = [sys.executable, "-m", "troupe.cli", "run", "--nworker-groups", "1", "--nservers-per-group", "1",
           "--server-worker-separate", str(ROOT / "benchmarks" / "ps_step.py"), "--steps", "8", "--burn-in", "2"]
    env = {**os.environ, "TROUPE_JOIN_TIMEOUT": "60", "TROUPE_TIMEOUT": "120", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "steps/s, sent during backward: True" in done.stdout, done.stdout
