"""The plain environment-variable contract of Kubernetes operators (Kubeflow's PyTorchJob).

Each pod gets MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK, and usually no LOCAL_RANK,
LOCAL_WORLD_SIZE or TORCHELASTIC_* variable: one process per pod, rank 0's pod hosts the store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from troupe.runtime import launch
from troupe.runtime.launch import LOOPBACK, free_port
from troupe.runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
TINY = str(Path(__file__).parent / "scripts" / "tiny_train.py")
DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
        "ROLE_RANK", "NODE_RANK")


def _pod_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """This machine's environment less every launcher's variables, plus the operator's four."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TROUPE_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI", "PMIX_")) and k not in DROP}
    return {**env, "OMP_NUM_THREADS": "1", "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size), "RANK": str(rank)}


@pytest.mark.parametrize("extra,local", [({}, (0, 1)), ({"LOCAL_RANK": "1"}, (1, 4)),
                                         ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 2))])
def test_detect_reads_the_four_variables(monkeypatch, extra, local):
    """No LOCAL_RANK: one process per pod (local rank 0 of 1, so a one-GPU pod picks NCCL)."""
    for name in list(os.environ):
        if name.startswith(("TROUPE_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI")) or name in DROP:
            monkeypatch.delenv(name)
    for k, v in {**_pod_env(3, 4, 29500), **extra}.items():
        monkeypatch.setenv(k, v)
    how = launch._detect(Settings.from_env({}), None, None, None, None)
    assert (how.launcher, how.rank, how.world_size, (how.local_rank, how.local_world)) == ("env", 3, 4, local)


def test_pytorchjob_environment(tmp_path):
    port = free_port(LOOPBACK)
    procs = [subprocess.Popen([sys.executable, TINY, str(tmp_path)], env=_pod_env(r, 2, port), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for s in states:
        assert s["world_size"] == 2 and s["launcher"] == "env"
        for a, b in zip(s["params"], states[0]["params"]):
            assert torch.equal(a, b)
