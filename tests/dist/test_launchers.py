"""The same script under every launcher: troupe run, Ticket + multiprocessing, torchrun, mpiexec."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = str(Path(__file__).parent / "scripts" / "tiny_train.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60"}


def run(cmd, timeout=120, env=ENV):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def check_ranks(out: Path, world_size: int, launcher: str, loop: str | None = None):
    """Every rank's saved parameters (of `loop`, in a run of several) are rank 0's."""
    states = [torch.load(out / (f"rank{r}.pt" if loop is None else f"rank{r}-{loop}.pt")) for r in range(world_size)]
    for s in states:
        assert s["world_size"] == world_size and s["launcher"] == launcher
        for a, b in zip(s["params"], states[0]["params"]):
            assert torch.equal(a, b)


LOOPS = ["sgd", "fp16"]
"""SINGA's sgd(loss), and the PyTorch loop (no_sync, GradScaler, clipping, StepLR) with a dist_option: both run
in the same job, one after the other (each launcher's processes start once)."""


def loop_args(loops: list[str]) -> list[str]:
    return [arg for loop in loops for arg in ("--loop", loop)]


def test_troupe_run(tmp_path):
    loops = ["sgd", "fp16", "sparseThreshold", "partialUpdate"]
    run([sys.executable, "-m", "troupe.cli", "run", "-n", "2", TINY, str(tmp_path), *loop_args(loops)])
    for loop in loops:
        check_ranks(tmp_path, 2, "troupe", loop)


@pytest.mark.slow
def test_ticket_multiprocessing(tmp_path):
    run([sys.executable, TINY, str(tmp_path), "--ticket", "3", *loop_args(LOOPS)])
    for loop in LOOPS:
        check_ranks(tmp_path, 3, "ticket", loop)


def test_torchrun(tmp_path):
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TINY, str(tmp_path),
         *loop_args(LOOPS)])
    for loop in LOOPS:
        check_ranks(tmp_path, 2, "torchrun", loop)


def test_slurm_srun_environment(tmp_path):
    """Two tasks started as srun starts them (the SLURM_* variables of a 2-task step on one node)."""
    procs = []
    for rank in range(2):
        env = {**ENV, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
               "SLURM_JOB_ID": str(4242 + os.getpid()), "SLURM_JOB_NODELIST": "localhost",
               "SLURM_TASKS_PER_NODE": "2"}
        procs.append(subprocess.Popen([sys.executable, TINY, str(tmp_path)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    check_ranks(tmp_path, 2, "slurm")


@pytest.mark.mpi
def test_mpiexec(tmp_path):
    mpiexec = shutil.which("mpiexec")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        mpiexec = None
    if mpiexec is None:
        pytest.skip("mpiexec/mpi4py not installed (pip install 'torch-troupe[mpi]'); the README's test setup installs them")
    env = {**ENV, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    run([mpiexec, "-n", "2", "--oversubscribe", sys.executable, TINY, str(tmp_path), *loop_args(LOOPS)], env=env)
    for loop in LOOPS:
        check_ranks(tmp_path, 2, "mpi", loop)


def test_troupe_run_starts_a_plain_ddp_script():
    """troupe run also sets torch's env:// variables (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK)."""
    script = str(Path(__file__).parent / "scripts" / "plain_ddp.py")
    proc = run([sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--threads", "1", script])
    assert sorted(re.findall(r"plain ddp rank (\d) of 2 ok", proc.stdout)) == ["0", "1"], proc.stdout


def test_single_process(tmp_path):
    run([sys.executable, TINY, str(tmp_path)])
    check_ranks(tmp_path, 1, "single")


@pytest.mark.slow
def test_mnist_example_reaches_accuracy():
    """Real MNIST, 2 ranks, one short epoch on 16k images (125 steps; measured 0.966 on the full test set,
    0.969 on 20k images, 0.955 on 12.8k): a real bar, not a smoke test (SINGA's train_one_batch). The
    example's PyTorch loop (`--loop torch`: accumulation, clipping, a scheduler)
    reached 0.971 on the same run; its shape is held to one process within 1e-5 by the conformance
    sample (tests/dist/test_conformance_matrix.py), so the suite does not train it a second time."""
    proc = run(
        [sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--threads", "1", "examples/mnist_cnn.py",
         "--epochs", "1", "--train-size", "16000", "--quiet"],
        timeout=240,
    )
    acc = [float(a) for a in re.findall(r"Evaluation accuracy = ([0-9.]+)", proc.stdout)]
    assert "Starting Epoch 0:" in proc.stdout and "training accuracy" in proc.stdout
    assert acc and acc[-1] >= 0.95, proc.stdout


DDP_TROUPE = str(Path(__file__).parent / "scripts" / "ddp_imports_troupe.py")


def test_a_ddp_script_joins_in_a_slurm_step(tmp_path):
    """`import troupe` gives a script that calls init_process_group() itself the env:// variables srun does not
    set (it died with torch's "environment variable RANK expected, but not set")."""
    procs = []
    for rank in range(3):
        env = {**ENV, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "3", "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
               "SLURM_JOB_ID": str(5151 + os.getpid()), "SLURM_JOB_NODELIST": "localhost",
               "SLURM_TASKS_PER_NODE": "3"}
        procs.append(subprocess.Popen([sys.executable, DDP_TROUPE], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == [f"ddp rank {r} of 3 ok" for r in range(3)]


@pytest.mark.mpi
def test_a_ddp_script_joins_under_mpiexec():
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not installed (pip install 'torch-troupe[mpi]'); the README's test setup installs it")
    env = {**ENV, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    proc = run([mpiexec, "-n", "2", "--oversubscribe", sys.executable, DDP_TROUPE], env=env)
    assert sorted(re.findall(r"ddp rank (\d) of 2 ok", proc.stdout)) == ["0", "1"], proc.stdout
