"""troupe run --stats/--timeline/--tensorboard: valid files with the expected rows, events and scalars (2 ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(Path(__file__).parent / "scripts" / "tiny_train.py")
OPTION_SCRIPT = str(Path(__file__).parent / "scripts" / "tiny_option.py")


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
    # tiny_train's model: 212 parameters in 4 tensors, one bucket with 4 used flags + 1 active flag
    # + 2 digest slots; a ring all-reduce on 2 ranks sends the whole buffer once: (212 + 7) * 4 bytes
    # per step. SINGA's methods exchange the step's agreement (12 bytes: troupe.sync.agree) at their first
    # step only; from then on it rides in the bucket's digest slots.
    for r in rows:
        if r["step"] > 1:  # step 1 also carries the initial broadcast of rank 0's parameters
            assert r["bytes_sent"] == (212 + 7) * 4
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


STEP_TAGS = ["time/step_ms", "time/forward_ms", "time/backward_ms", "time/optimizer_ms", "time/compute_ms",
             "comm/exposed_ms", "comm/overlapped_ms", "comm/bytes_sent", "train/loss"]


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def troupe_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60"}
    proc = subprocess.run([sys.executable, "-m", "troupe.cli", "run", "-n", "2", *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.slow
def test_tensorboard_alone_writes_every_steps_scalars_per_rank(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the test extra has it)")
    board = tmp_path / "tb"
    proc = troupe_run("--tensorboard", str(board), TINY, str(tmp_path))
    assert f"TensorBoard scalars in {board}" in proc.stderr
    assert "per-step means" not in proc.stderr  # no --stats: TensorBoard alone turns recording on
    assert sorted(p.name for p in board.iterdir()) == ["rank0", "rank1"]
    losses = []
    for rank in (0, 1):
        scalars = read_scalars(board / f"rank{rank}")
        assert set(STEP_TAGS) <= set(scalars), sorted(scalars)
        assert "comm/compression_ratio" not in scalars  # plain steps carry no ratio
        for tag in STEP_TAGS:
            assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4, 5], tag
            assert all(v >= 0 for _, v in scalars[tag]), tag
        # the same count as the stats test: the whole (212 + 7)-float bucket, once per step on 2 ranks,
        # and at the first step the agreement's 12 bytes
        assert [v for _, v in scalars["comm/bytes_sent"]][1:] == [(212 + 7) * 4] * 4
        first = scalars["comm/bytes_sent"][0][1]
        assert first > (212 + 7) * 4 + 12 if rank == 0 else first == (212 + 7) * 4 + 12  # rank 0 also broadcast
        step_ms = dict(scalars["time/step_ms"])
        for step, v in scalars["time/compute_ms"]:
            assert v == pytest.approx(step_ms[step] - dict(scalars["comm/exposed_ms"])[step], abs=1e-3)
        losses.append([v for _, v in scalars["train/loss"]])
    # cross-entropy over 4 classes starts near ln 4; each rank sees its own batches
    for rank_losses in losses:
        assert all(0 < v < 5 for v in rank_losses)
    assert losses[0] != losses[1]


def test_tensorboard_scalars_equal_the_stats_rows_with_compression(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the test extra has it)")
    board, stats = tmp_path / "tb", tmp_path / "stats.jsonl"
    troupe_run("--tensorboard", str(board), "--stats", str(stats), OPTION_SCRIPT, "fp16")
    rows = [json.loads(line) for line in stats.read_text().splitlines()]
    for rank in (0, 1):
        scalars = read_scalars(board / f"rank{rank}")
        mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["step"])
        assert [r["step"] for r in mine] == [1, 2, 3, 4, 5]
        for key, tag in (("time_ms", "time/step_ms"), ("comm_exposed_ms", "comm/exposed_ms"),
                         ("bytes_sent", "comm/bytes_sent"), ("loss", "train/loss"),
                         ("ratio", "comm/compression_ratio"), ("residual_norm", "comm/residual_norm")):
            expected = [(r["step"], r[key]) for r in mine if key in r]
            assert expected, key
            assert [s for s, _ in scalars[tag]] == [s for s, _ in expected], tag
            assert [v for _, v in scalars[tag]] == pytest.approx([v for _, v in expected], rel=1e-6), tag
        # fp16 sends half the bytes of the dense fp32 step; every step's row carries its own ratio
        # (before engine v2 the row of step k carried step k-1's, so step 1 had none)
        assert [v for _, v in scalars["comm/compression_ratio"]] == pytest.approx([0.5] * 5, abs=0.02)
