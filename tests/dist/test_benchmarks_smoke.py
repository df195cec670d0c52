"""`troupe bench run ddp` (DDP vs troupe) runs end to end in a tiny configuration (harness, not timing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.benchmark]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ddp_vs_troupe_prints_its_table():
    env = {**os.environ, "TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60"}
    cmd = [
        sys.executable, "-m", "troupe.cli", "bench", "run", "ddp", "-n", "2", "--threads", "1", "--workload", "cnn",
        "--data", "synthetic", "--steps", "2", "--burnin", "1", "--reps", "2", "--batch-size", "8",
        "--sweep", "2**12,all", "--local", "--timeout", "80",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "| strategy | buckets | step ms (median) | spread (min-max) |" in out
    for row in ("| DDP |", "| troupe bucket 2**12 |", "| troupe bucket all | 1 |", "| local (no communication) |"):
        assert row in out, out


def test_accumulate_runs_troupe_and_ddp_with_no_sync(tmp_path):
    from troupe.bench.records import read

    out = tmp_path / "a.jsonl"
    cmd = [sys.executable, "-m", "troupe.cli", "bench", "run", "accumulate", "-n", "2", "--workload", "mlp",
           "--data", "synthetic", "--batch-size", "8", "--micro", "4", "--steps", "2", "--burnin", "1", "--reps", "2",
           "--timeout", "80", "--out", str(out)]
    env = {**os.environ, "TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| DDP no_sync x4 |" in proc.stdout and "| troupe no_sync x4 |" in proc.stdout
    steps = [r for r in read(out) if r.metric == "step_time"]
    assert sorted({r.contestant for r in steps}) == ["DDP no_sync x4", "troupe no_sync x4"] and len(steps) == 4
    # troupe reduces once per step (the last micro-batch): the MLP's gradient (50,890 fp32) on a 2-rank ring
    sent = [r.value for r in read(out) if r.metric == "wire_bytes"]
    assert sent and all(50890 * 4 <= v < 50890 * 4 + 1024 for v in sent)
