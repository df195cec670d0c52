"""A covering sample of the conformance matrix (`troupe bench run conformance`, docs/conformance.md).

Every regime once, every script shape once, every launcher once (not their product: the whole matrix is the
benchmark). Each cell is a whole job of `troupe/bench/conformance_cell.py`, killed at CELL_TIMEOUT, and must end
the way the matrix says it does: equal to one process on the whole batch, the stated loss reached, or a one-line
refusal within 10 s. Two cells run at a time.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from troupe.bench.suites import conformance as matrix

pytestmark = [pytest.mark.mpi, pytest.mark.benchmark, pytest.mark.slow]

CELL_TIMEOUT = 60.0
SAMPLE = [  # (regime, shape, launcher, how it ends)
    ("plain", "singa", "torchrun", "matched"),
    ("fp16", "torch", "mpiexec", "matched"),
    ("bf16", "ddp", "env", "matched"),
    ("partialUpdate", "tied", "slurm", "reached"),
    ("sparseTopK", "eval", "ticket", "reached"),
    ("sparseThreshold", "compiled", "troupe", "reached"),
    ("powerSGD", "torch", "troupe", "reached"),
    ("sandblaster", "torch", "troupe", "matched"),  # clipping clips the group's mean (it clipped each worker's)
    ("allreduce", "singa", "troupe", "matched"),
    ("downpour", "ddp", "troupe", "reached"),  # the script's own process group, sampler and destroy
    ("hogwild", "ddp", "troupe", "reached"),
    ("diloco", "eval", "troupe", "reached"),
    ("streaming-diloco", "eval", "troupe", "reached"),
    ("partition", "torch", "troupe", "matched"),
    ("shard-optimizer", "tied", "troupe", "matched"),
    ("shard-gradients", "torch", "troupe", "matched"),
    ("shard-parameters", "singa", "troupe", "matched"),  # train_one_batch's self.forward(x) gathers the shards
    ("plain --elastic", "ddp", "troupe", "refused"),
]


def test_a_covering_sample_of_the_matrix_ends_as_stated(tmp_path):
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not installed (pip install 'torch-troupe[mpi]'); the README's test setup installs it")
    base = matrix.environment()
    # The compiled shape's reference is the eager one of the same loop (the eval shape: evaluation moves nothing).
    refs = matrix.references(["singa", "torch", "ddp", "tied", "eval"], base, tmp_path, CELL_TIMEOUT)
    refs["compiled"] = refs["eval"]

    def cell(row):
        regime, shape, launcher, _ = row
        return matrix.run_cell(matrix.REGIMES[regime], shape, launcher, base, CELL_TIMEOUT, refs[shape], tmp_path)

    with ThreadPoolExecutor(2) as pool:
        ended = list(pool.map(cell, SAMPLE))
    wrong = [f"{regime} x {shape} x {launcher}: {outcome} ({said}), expected {expected}"
             for (regime, shape, launcher, expected), (outcome, said, _) in zip(SAMPLE, ended) if outcome != expected]
    assert not wrong, "\n".join(wrong)
    refused = ended[-1][1]
    assert "under troupe run --elastic troupe makes the process groups" in refused, refused
