"""The MNIST example partitioned: `--partition hybrid` trains the same function as data parallelism."""

from __future__ import annotations

import re
import sys

from tests.dist.test_launchers import run


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
              "--epochs", "1", "--train-size", "3840", "--max-steps", "30", "--quiet", "--loop", "torch",
              "--clip", "2"]
    data = _numbers(run(common, timeout=180).stdout)
    hybrid = _numbers(run([*common, "--partition", "hybrid", "--workers-per-group", "2"], timeout=180).stdout)
    assert abs(hybrid[0] - data[0]) < 1e-4 * data[0], (data, hybrid)
    assert abs(hybrid[1] - data[1]) < 2e-3, (data, hybrid)
