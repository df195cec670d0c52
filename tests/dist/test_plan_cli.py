"""`troupe plan` as a user runs it (a subprocess on examples/mnist_cnn.py), the link measured by
two spawned Gloo processes, and ``troupe.partition(model, "auto", ...)`` on a 2-rank world:
every rank gets rank 0's plan, the model still computes what one process computes, and a
failure on rank 0 is raised on every rank instead of hanging."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.dist.test_partition import CNN
from tests.dist.world import run_world

ROOT = Path(__file__).resolve().parents[2]
PLAN = [sys.executable, "-m", "troupe.cli", "plan"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
B_OWN = 3


def plan(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PLAN, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_plan_mnist_cnn_prints_candidates_and_a_pick():
    proc = plan("examples/mnist_cnn.py", "-n", "4", "--link", "1gbit", "--input", "1,28,28")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "conv1, conv2, linear1, linear2" in lines[1]
    rows = [line.split() for line in lines if line.startswith(("data parallel", "best for", "one weird", "all dim"))]
    dp = [r for r in rows if r[:2] == ["data", "parallel"] and "plain" in r]
    assert len(dp) == 1 and dp[0][-7:-4] == ["0,0,0,0", "plain", "exact"], dp
    times = [float(r[-4]) for r in rows]
    assert times == sorted(times) and all(t > 0 for t in times)
    assert float(dp[0][-2]) == 1.724  # param MB/worker: 431,080 fp32 parameters
    assert float(dp[0][-1]) == 3.449  # state MB/worker: and their gradients
    picked = [line for line in lines if line.startswith("picked: ")]
    assert len(picked) == 1 and "option plain" in picked[0]
    fastest_plain = min(float(r[-4]) for r in rows if "plain" in r)
    assert f"{fastest_plain:.2f} ms/step" in picked[0]


def test_plan_bad_input_exits_2_with_one_line():
    # one process each (torch's import dominates): the other bad inputs are tests/unit/test_planner.py's
    proc = plan("examples/mnist_cnn.py", "-n", "4", "--workers-per-group", "3", "--input", "1,28,28", timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "troupe plan: --workers-per-group 3 does not divide -n 4 (divisors: [1, 2, 4])\n"
    proc = plan("examples/mnist_cnn.py", "-n", "zero", timeout=60)
    assert proc.returncode == 2 and proc.stderr == "troupe plan: -n must be a positive integer, got 'zero'\n"


def test_measured_link_is_a_plausible_line():
    from troupe.partition.planner import measure_link

    link = measure_link(timeout=60)
    assert math.isfinite(link.alpha) and math.isfinite(link.beta)
    assert link.beta > 0 and 0 <= link.alpha < 0.05  # loopback: well under 50 ms per message


def _auto(rank: int, world_size: int, link: str) -> tuple[dict[str, int], list[str | None], bool]:
    """Bad inputs first (each must raise the same error on every rank), then rank 0's plan for `link`
    on every rank, which must still compute what one process computes."""
    import troupe

    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = CNN()
    torch.manual_seed(rank)  # partition must replace it by rank 0's model
    model = CNN()
    batch = torch.randn(world_size * B_OWN, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    own = batch[rank * B_OWN : (rank + 1) * B_OWN]
    wrong = torch.randn(B_OWN, 3, 16, 16)
    if link == "job":  # rank 1's step fails while rank 0's would not
        bad = [("job", wrong if rank == 1 else own, None)]
    else:  # no sample (every rank); rank 0 cannot profile; a memory budget no plan fits
        bad = [("loopback", None, None), ("loopback", wrong, None), ("loopback", own, 1000)]
    errors: list[str | None] = []
    for bad_link, sample, memory in bad:
        try:
            troupe.partition(CNN(), "auto", workers_per_group=2, sample=sample, link=bad_link, memory_per_rank=memory)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    troupe.partition(model, "auto", workers_per_group=2, sample=own, link=link)
    dims = {row.name: row.partition_dim for row in troupe.partition.describe(model)
            if row.type in ("Linear", "Conv2d")}
    with torch.no_grad():
        same = torch.allclose(model(own), reference(batch)[rank * B_OWN : (rank + 1) * B_OWN], atol=1e-5)
    return dims, errors, same


def test_partition_auto_gives_every_rank_rank0s_plan():
    (dims0, errors0, same0), (dims1, errors1, same1) = run_world(_auto, 2, "alpha=0s,beta=10gbit", timeout=120)
    assert dims0 == dims1 and set(dims0) == {"conv1", "conv2", "fc1", "fc2"}
    assert all(d in (0, 1, -1) for d in dims0.values())
    assert same0 and same1
    assert errors0 == errors1
    assert errors0[0].startswith("plan 'auto' needs sample=")
    assert errors0[1].startswith("plan 'auto' failed on rank 0: ValueError: profiling CNN's forward")
    assert errors0[2].startswith("plan 'auto' failed on rank 0: ValueError: no partition plan for workers_per_group 2 "
                                 "fits 0.0 MiB of model state per worker: the smallest needs ")


def _calibrate(rank: int, world_size: int):
    import troupe
    from troupe.partition.planner import calibrate

    torch.set_num_threads(1)
    model = CNN()
    x = torch.randn(B_OWN, 1, 16, 16)

    def local_step(i: int) -> None:
        model.zero_grad()
        model(x).sum().backward()

    return calibrate(troupe.init().comm, local_step, reps=3, steps=2, burnin=1).to_json()


def test_calibrate_in_a_two_rank_job_gives_every_rank_the_same_costs():
    first, second = run_world(_calibrate, 2, timeout=120)
    assert first == second  # every probe's time is the slowest rank's, so both ranks solve alike
    numbers = [first["sync_s"], *first["reduce"], *(v for link in first["exchanges"].values() for v in link)]
    assert all(math.isfinite(v) and v >= 0 for v in numbers)
    assert set(first["exchanges"]) == {"all_gather", "all_to_all", "reduce_scatter", "send"}
    assert first["reduce"][0] > 0 or first["reduce"][1] > 0  # a DistOpt step of 8 MiB over Gloo is not free


def test_partition_auto_with_the_job_link_measures_in_the_step_and_agrees():
    (dims0, errors0, same0), (dims1, errors1, same1) = run_world(_auto, 2, "job", timeout=180)
    assert dims0 == dims1 and set(dims0) == {"conv1", "conv2", "fc1", "fc2"}
    assert same0 and same1
    assert errors0 == errors1 and len(errors0) == 1
    assert errors0[0].startswith("plan 'auto' with link 'job': the model's step failed (rank 1: ")
