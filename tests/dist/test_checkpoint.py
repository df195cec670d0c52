"""Checkpoints: atomic, verified, pruned; resume equals an uninterrupted run; --max-restarts recovers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.dist.world import run_world

ROOT = Path(__file__).resolve().parents[2]


def _save_and_reload(rank, world_size, directory):
    import pytest

    import troupe
    from troupe.reliability import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 4):
        opt(model(torch.randn(4, 6, generator=g)).square().mean())
        checkpoint.save(directory, step, model, opt, {"epoch": 0, "batch": step}, keep=2)
    kept = sorted(p.name for p in Path(directory).iterdir())
    opt.communicator.barrier()
    expected_params = [p.detach().clone() for p in model.parameters()]
    expected_momentum = [opt.optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    # A save that died before its manifest, newer than everything: ignored.
    partial = Path(directory) / "step-00000009"
    partial.mkdir(exist_ok=True)
    (partial / f"rank{rank}.pt").write_bytes(b"half a file")
    assert checkpoint.latest(directory).name == "step-00000003"
    opt.communicator.barrier()
    if rank == 0:  # corrupt the newest complete checkpoint: latest() falls back to the previous one
        path = Path(directory) / "step-00000003" / "rank1.pt"
        path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
    opt.communicator.barrier()
    assert checkpoint.latest(directory).name == "step-00000002"
    with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch"):
        checkpoint.load(Path(directory) / "step-00000003", model, opt)

    fresh = torch.nn.Linear(6, 3)
    fresh_opt = troupe.DistOpt(torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    extra = checkpoint.load(Path(directory) / "step-00000002", fresh, fresh_opt)
    assert extra["step"] == 2 and extra["batch"] == 2

    with pytest.raises(checkpoint.CheckpointError, match="does not match"):
        checkpoint.load(Path(directory) / "step-00000002", torch.nn.Linear(6, 4), fresh_opt)
    return kept, expected_params, expected_momentum, [p.detach() for p in fresh.parameters()]


def test_save_prune_verify_and_load(tmp_path):
    results = run_world(_save_and_reload, 2, str(tmp_path))
    for kept, params3, _, loaded2 in results:
        assert kept == ["step-00000002", "step-00000003"]
        assert all(not torch.equal(a, b) for a, b in zip(params3, loaded2))  # step 2 != step 3
    assert all(torch.equal(a, b) for a, b in zip(results[0][3], results[1][3]))


def test_world_size_mismatch_refused(tmp_path):
    # A data-parallel checkpoint resumes on any world size (tests/dist/test_checkpoint_reshard.py);
    # one whose state belongs to each rank (partial update: each rank's own parameters) does not.
    run_world(_save_one, 2, str(tmp_path))
    results = run_world(_load_expect_error, 1, str(tmp_path))
    assert "written by 2 ranks, this job has 1" in results[0]
    assert "partial update" in results[0]


def _save_one(rank, world_size, directory):
    import troupe
    from troupe.reliability import checkpoint

    model = torch.nn.Linear(2, 2)
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.backward_and_partial_update(model(torch.full((1, 2), float(rank))).sum())
    checkpoint.save(directory, 5, model, opt)


def _load_expect_error(rank, world_size, directory):
    import troupe
    from troupe.reliability import checkpoint

    model = torch.nn.Linear(2, 2)
    try:
        checkpoint.load(checkpoint.latest(directory), model, troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1)))
    except checkpoint.CheckpointError as e:
        return str(e)
    return "loaded"


def _example(*args, timeout=180, launcher=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60"}
    launcher = launcher or [sys.executable, "-m", "troupe.cli", "run", "-n", "2"]
    # 320 samples, batch 16 on each of 2 ranks: 10 steps an epoch, a checkpoint every 5 (steps 5, 10, 15); the
    # epoch's printed loss and accuracies are what a resume must reproduce, whatever the batch (64 and 1000 test
    # images cost 4 times the CPU for the same check)
    cmd = [*launcher, *args[0], "examples/mnist_cnn.py",
           "--epochs", "2", "--train-size", "320", "--batch-size", "16", "--test-size", "160", "--checkpoint-every",
           "5", "--quiet", *args[1]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
def test_restart_after_a_crash_matches_an_uninterrupted_run(tmp_path):
    # Rank 1 dies at step 17, in epoch 1 (steps 10 to 19), after the checkpoint of step 15.
    # The three runs are independent: they run side by side (each mostly waits on its own two ranks).
    torchrun_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "--max-restarts", "1"]
    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(_example, ["--checkpoint-dir", str(tmp_path / "a")], []),
                pool.submit(_example, ["--checkpoint-dir", str(tmp_path / "b"), "--max-restarts", "1"],
                            ["--crash-at-step", "17"]),
                pool.submit(_example, [], ["--checkpoint-dir", str(tmp_path / "c"), "--crash-at-step", "17"],
                            launcher=torchrun_cmd)]
        clean, crashed, torchrun = (run.result() for run in runs)
    assert clean.returncode == 0, clean.stderr
    assert crashed.returncode == 0, crashed.stderr
    assert "rank 1 exited with code 17" in crashed.stderr and "restart 1 of 1" in crashed.stderr
    assert "Resumed from" in crashed.stdout and "step-00000015" in crashed.stdout

    def epoch_lines(out):
        return re.findall(r"(Training loss = .*, training accuracy = .*)\n(Evaluation accuracy = [0-9.]+)", out)

    # Epoch 1 (where the crash happened) is reproduced to the last printed digit.
    assert epoch_lines(crashed.stdout)[-1] == epoch_lines(clean.stdout)[-1]

    # torchrun --max-restarts: the restarted attempt resumes by itself and reproduces the epoch too
    # (torch reuses its agent's store across attempts; troupe prefixes each attempt's keys).
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert "Resumed from" in torchrun.stdout and "step-00000015" in torchrun.stdout
    assert epoch_lines(torchrun.stdout)[-1] == epoch_lines(clean.stdout)[-1]

    # An explicit --resume continues the finished job's last checkpoint: nothing left but the final epoch.
    resumed = _example(["--resume", str(tmp_path / "a")], [])
    assert resumed.returncode == 0 and "Resumed from" in resumed.stdout
    assert epoch_lines(resumed.stdout)[-1] == epoch_lines(clean.stdout)[-1]


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = _example(["--resume", str(tmp_path / "empty")], [], timeout=60)
    assert proc.returncode != 0 and "no complete checkpoint" in proc.stderr


def _die_during_second_save(rank, world_size, directory):
    import os

    import troupe
    from troupe.reliability import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt(model(torch.randn(4, 6)).square().mean())
    checkpoint.save(directory, 1, model, opt)
    good = [p.detach().clone() for p in model.parameters()]
    opt(model(torch.randn(4, 6)).square().mean())
    if rank == 1:
        real_write = checkpoint._atomic_write

        def write_half_then_die(path, data):
            with open(path.with_name(f".{path.name}.tmp-{os.getpid()}"), "wb") as f:
                f.write(data[: len(data) // 2])
            os._exit(9)  # the machine stops mid-write

        checkpoint._atomic_write = write_half_then_die
        try:
            checkpoint.save(directory, 2, model, opt)
        finally:
            checkpoint._atomic_write = real_write
    else:
        try:
            checkpoint.save(directory, 2, model, opt)
        except Exception:
            pass  # rank 1 died: the save cannot complete
    return good


def _resume(rank, world_size, directory):
    import troupe
    from troupe.reliability import checkpoint

    model = torch.nn.Linear(6, 3)
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    found = checkpoint.latest(directory)
    extra = checkpoint.load(found, model, opt)
    return found.name, extra["step"], [p.detach() for p in model.parameters()]


def test_crash_during_save_leaves_the_previous_checkpoint(tmp_path):
    import pytest

    from tests.dist.world import RankFailed

    with pytest.raises((RankFailed, TimeoutError)):
        run_world(_die_during_second_save, 2, str(tmp_path), timeout=60)
    assert (tmp_path / "step-00000001" / "MANIFEST.json").exists()
    assert not (tmp_path / "step-00000002" / "MANIFEST.json").exists()
    for name, step, params in run_world(_resume, 2, str(tmp_path)):
        assert name == "step-00000001" and step == 1
        assert all(bool(torch.isfinite(p).all()) for p in params)
