"""torch.nn.utils.clip_grad_norm_ in a user's loop on troupe's parameters (partition/torch_clip.py).

A sharded DistOpt leaves ``p.grad`` None after the reduction (the mean lives in its parts' grads) and a
partitioned model holds one worker's slices: torch's own function clipped nothing, or by each worker's
norm, without a word. On 2 Gloo ranks, each loop clips with torch's function by a max_norm the gradient
exceeds, and must end where one process clipping the whole model's gradient ends (the same norm, the same
parameters); the same loop under Sandblaster with ``troupe run --elastic`` (each worker holds its own gradient)
is refused in one line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.world import run_world

pytestmark = [pytest.mark.dist]

STEPS, BATCH, MAX_NORM = 3, 8, 0.05
CELL = str(Path(__file__).resolve().parents[2] / "src" / "troupe" / "bench" / "conformance_cell.py")


def make(partition: int | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer; `partition`: the last layer's output features over that many workers first
    (the optimizer is made after troupe.partition, over the slices)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if partition is not None:
        import troupe

        troupe.partition(model, {"2": 1}, partition)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS * BATCH, 8, generator=g), torch.randn(STEPS * BATCH, 4, generator=g)


def world(rank: int, world_size: int, how: str, clip: str = "torch") -> dict:
    import troupe

    torch.set_num_threads(1)
    model, opt = make(world_size if how == "partition" else None)
    sgd = troupe.DistOpt(opt, shard=None if how == "partition" else how)
    x, y = data()
    per = BATCH // sgd.world_size  # data-parallel replicas (a partitioned model's 2 workers compute one)
    norms = []
    for step in range(STEPS):
        rows = slice(step * BATCH + sgd.global_rank * per, step * BATCH + (sgd.global_rank + 1) * per)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        sgd.synchronize()
        clip_grad_norm_ = troupe.clip_grad_norm_ if clip == "troupe" else torch.nn.utils.clip_grad_norm_
        norms.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
        sgd.step()
        sgd.zero_grad()
    whole = troupe.full_state_dict(model) if how == "partition" else model.state_dict()
    return {"norms": norms, "state": {k: v.detach().clone() for k, v in whole.items()}}


def reference() -> dict:
    model, opt = make()
    x, y = data()
    norms = []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "state": model.state_dict()}


@pytest.mark.parametrize("how", ["optimizer", "gradients"])
def test_torchs_clip_grad_norm_clips_a_sharded_distopts_whole_gradient(how):
    ref = reference()
    assert min(ref["norms"]) > 4 * MAX_NORM  # every step clips
    for rank, got in enumerate(run_world(world, 2, how, timeout=120)):
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), (rank, got["norms"], ref["norms"])
        for name, value in ref["state"].items():
            assert torch.allclose(got["state"][name], value, atol=1e-6), (rank, name)


def test_torchs_clip_grad_norm_on_a_partitioned_model_is_troupes():
    """The whole model's norm, the same on both workers (torch's own saw each worker's slices: two norms), and the
    one-process loop's parameters; troupe's own clip_grad_norm_ gives the same bits."""
    ref = reference()
    torchs, troupes = (run_world(world, 2, "partition", clip, timeout=120) for clip in ("torch", "troupe"))
    for rank in range(2):
        assert torchs[rank]["norms"] == troupes[rank]["norms"] == troupes[0]["norms"], (torchs, troupes)
        assert torchs[rank]["norms"] == pytest.approx(ref["norms"], rel=1e-5), (rank, torchs[rank]["norms"])
        for name, value in troupes[rank]["state"].items():
            assert torch.equal(torchs[rank]["state"][name], value), (rank, name)
            assert torch.allclose(value, ref["state"][name], atol=1e-6), (rank, name)


def _partition_after_the_optimizer(rank: int, world_size: int) -> str:
    import troupe

    torch.set_num_threads(1)
    model, opt = make()
    troupe.partition(model, {"2": 1}, world_size)
    try:
        troupe.DistOpt(opt)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_an_optimizer_made_before_the_partition_is_refused_in_one_line():
    """It holds the whole layer the partition replaced: it would step a tensor the model no longer uses, while
    the slices' gradients were never reduced (no error, a wrong model)."""
    for said in run_world(_partition_after_the_optimizer, 2, timeout=120):
        assert said.startswith("the optimizer holds the parameters of 2, which troupe.partition replaced"), said
        assert "create the optimizer after troupe.partition" in said and "\n" not in said


def test_clipping_under_elastic_sandblaster_is_refused_in_one_line(tmp_path):
    """Each worker holds its own gradient there (a restarted worker rejoins alone): clipping it is not clipping the
    group's mean, which the same loop without --elastic clips."""
    cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", "3", "--threads", "1", "--framework", "sandblaster",
           "--nworkers-per-group", "2", "--nservers-per-group", "1", "--elastic", CELL, str(tmp_path), "--shape",
           "torch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = re.findall(r"^troupe: rank \d: (.*)$", proc.stderr, re.M)
    assert said and said[0].startswith("clip_grad_norm_ under troupe run --elastic: Sandblaster's workers"), \
        proc.stderr[-2000:]
    assert "run without --elastic, or with --nworkers-per-group 1" in said[0]
    assert not (tmp_path / "model.pt").exists()
