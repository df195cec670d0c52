"""troupe run --stats/--timeline: valid files with the expected rows and events for a 2-rank run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = str(Path(__file__).parent / "scripts" / "tiny_train.py")


def test_stats_and_timeline(tmp_path):
    stats, timeline = tmp_path / "stats.jsonl", tmp_path / "trace.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--stats", str(stats), "--timeline", str(timeline),
         TINY, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "per-step means" in proc.stderr and "comm_exposed" in proc.stderr

    rows = [json.loads(line) for line in stats.read_text().splitlines()]
    assert sorted((r["rank"], r["step"]) for r in rows) == [(r, s) for r in (0, 1) for s in range(1, 6)]
    # tiny_train's model: 212 parameters in 4 tensors, one bucket with 4 used flags + 1 active flag;
    # a ring all-reduce on 2 ranks sends the whole buffer once: (212 + 5) * 4 bytes per step.
    for r in rows:
        if r["step"] > 1:  # step 1 also carries the initial broadcast of rank 0's parameters
            assert r["bytes_sent"] == (212 + 5) * 4
        for key in ("time_ms", "forward_ms", "backward_ms", "comm_exposed_ms", "comm_overlapped_ms", "optimizer_ms"):
            assert r[key] >= 0
        assert r["time_ms"] >= r["backward_ms"] + r["optimizer_ms"] - 1e-6

    events = json.loads(timeline.read_text())["traceEvents"]
    assert not list(tmp_path.glob("trace.rank*.json"))  # merged into one file
    for rank in (0, 1):
        names = [e["name"] for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert names.count("backward") == 5 and names.count("optimizer step") == 5
        assert names.count("all_reduce") >= 5 and "broadcast" in names
        assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
