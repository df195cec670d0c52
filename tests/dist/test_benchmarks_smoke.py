"""The DDP-vs-troupe benchmark runs end to end in a tiny configuration (harness, not timing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ddp_vs_troupe.py"


def test_ddp_vs_troupe_prints_its_table():
    env = {**os.environ, "TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60"}
    cmd = [
        sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--threads", "1", str(SCRIPT),
        "--data", "synthetic", "--steps", "2", "--warmup", "1", "--reps", "2", "--batch-size", "8",
        "--sweep", "2**12,all", "--local",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "| strategy | buckets | step ms (median) | spread (min-max) |" in out
    for row in ("| DDP |", "| troupe bucket 2**12 |", "| troupe bucket all | 1 |", "| local (no communication) |"):
        assert row in out, out
