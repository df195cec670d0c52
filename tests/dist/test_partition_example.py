"""The MNIST example partitioned: `--partition hybrid` trains the same function as data parallelism."""

from __future__ import annotations

import re
import sys

import pytest

from tests.dist.test_launchers import run

pytestmark = [pytest.mark.slow]


def _numbers(stdout: str) -> tuple[float, float]:
    loss = re.search(r"Training loss = ([0-9.]+)", stdout)
    acc = re.search(r"Evaluation accuracy = ([0-9.]+)", stdout)
    assert loss and acc, stdout
    return float(loss.group(1)), float(acc.group(1))


def test_example_hybrid_partition_trains_what_data_parallelism_trains():
    """2 ranks in one group: convolutions split the batch, linear layers their output features.
    Same initial model (rank 0's), same batches, same averaged update: the losses agree to
    rounding (the linear layers multiply a gathered batch, so sums run in another order)."""
    common = [sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--threads", "1", "examples/mnist_cnn.py",
              "--epochs", "1", "--train-size", "1920", "--test-size", "2000", "--max-steps", "15", "--quiet",
              "--loop", "torch", "--clip", "2"]
    data = _numbers(run(common, timeout=180).stdout)
    hybrid = _numbers(run([*common, "--partition", "hybrid", "--workers-per-group", "2"], timeout=180).stdout)
    assert abs(hybrid[0] - data[0]) < 1e-4 * data[0], (data, hybrid)
    assert abs(hybrid[1] - data[1]) < 2e-3, (data, hybrid)


def test_example_partitioned_by_the_cluster_block_under_sandblaster(tmp_path):
    """`troupe run --cluster job.conf` with partition_dim in the block: the script does not change,
    each worker sends and fetches only its own slices, and the servers train what they train for
    the whole model on both workers (the same losses to rounding)."""
    block = "cluster {{\n  nworkers_per_group: 2\n  nservers_per_group: 1\n  server_worker_separate: true\n{}}}\n"
    plain, split = tmp_path / "plain.conf", tmp_path / "split.conf"
    plain.write_text(block.format(""))
    split.write_text(block.format("  partition_dim: 1\n"))
    common = ["--threads", "1", "examples/mnist_cnn.py", "--epochs", "1", "--train-size", "1920", "--test-size", "2000",
              "--max-steps", "15", "--quiet", "--loop", "torch"]
    cli = [sys.executable, "-m", "troupe.cli", "run", "--cluster"]
    data = _numbers(run([*cli, str(plain), *common], timeout=180).stdout)
    proc = run([*cli, str(split), *common], timeout=180)
    assert "partition (cluster): conv1:1" in proc.stdout, proc.stdout
    model = _numbers(proc.stdout)
    assert abs(model[0] - data[0]) < 1e-4 * data[0], (data, model)
    assert abs(model[1] - data[1]) < 2e-3, (data, model)
