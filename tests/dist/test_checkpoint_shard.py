"""Checkpoints of sharded jobs (``DistOpt(shard=...)`` and ``troupe.shard``) resume on another number of
ranks, sharded another way or not at all, and equal one process training as many steps.

Three worlds: 4 ranks train and save (a ZeRO-1 job, blocking and asynchronous saves; a troupe.shard
job; a plain job), 2 ranks resume each checkpoint in another regime and save again, 3 ranks resume
that; the reference (one process, the combined batch) runs in the test process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.dist.world import run_world

pytestmark = [pytest.mark.slow]

BATCH = 12  # the global batch: 3, 4 or 6 rows per rank on 4, 3 or 2 ranks
N, M, K = 3, 2, 1  # steps on 4 ranks, then on 2, then on 3
TOL = 1e-5


def _model():
    torch.manual_seed(0)  # 212 elements: the 4, 3 and 2 chunks of a bucket cut parameters in the middle
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _adamw(model):
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=0.05)


def _loss(model, step, rank=0, world_size=1):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 8, generator=gen)
    own = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    return model(x[own]).square().mean()


def _job(regime: str):
    """(model, DistOpt) of one regime: "plain", "optimizer", "gradients" (DistOpt's shard) or "fsdp"."""
    import troupe

    model = _model()
    if regime == "fsdp":
        model = troupe.shard(model)
    shard = regime if regime in ("optimizer", "gradients") else None
    return model, troupe.DistOpt(_adamw(model), shard=shard)


def _train(model, opt, steps, rank, world_size):
    for step in steps:
        loss = _loss(model, step, rank, world_size)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _params(model):
    import troupe

    return {k: v.clone() for k, v in troupe.full_state_dict(model).items()}


def _four(rank, world_size, directory):
    """Train N steps and save, in each regime; the async save is followed by a step before it is waited for."""
    from troupe.reliability import checkpoint

    d = Path(directory)
    for regime in ("optimizer", "fsdp", "plain"):
        model, opt = _job(regime)
        _train(model, opt, range(N), rank, world_size)
        checkpoint.save(d / regime, N, model, opt)
        if regime != "plain":  # (plain's asynchronous save: tests/dist/test_checkpoint_async.py)
            checkpoint.save(d / f"{regime}-async", N, model, opt, async_save=True)
            _train(model, opt, [N], rank, world_size)  # changes the state while the save is in flight
            checkpoint.wait()
    return json.loads((d / "optimizer" / f"step-{N:08d}" / "MANIFEST.json").read_text())


RESUMES = [("optimizer", "gradients"), ("optimizer-async", "plain"), ("plain", "optimizer"), ("fsdp", "fsdp"),
           ("fsdp-async", "plain"), ("optimizer", "fsdp"), ("plain", "fsdp")]
"""(the 4-rank checkpoint, the regime that resumes it on 2 ranks)."""


def _two(rank, world_size, directory):
    """Resume every checkpoint of `_four` in another regime, train M steps; save the ZeRO-2 one for `_three`;
    a checkpoint of another model is refused."""
    from troupe.reliability import checkpoint

    d = Path(directory)
    out = {}
    for source, regime in RESUMES:
        model, opt = _job(regime)
        info = checkpoint.load(checkpoint.latest(d / source), model, opt)
        assert info["step"] == N
        _train(model, opt, range(N, N + M), rank, world_size)
        out[source, regime] = _params(model)
        if (source, regime) == ("optimizer", "gradients"):
            checkpoint.save(d / "two", N + M, model, opt)
    other = nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 4))
    import troupe

    try:
        checkpoint.load(checkpoint.latest(d / "optimizer"), other, troupe.DistOpt(_adamw(other), shard="optimizer"))
        out["refused"] = None
    except checkpoint.CheckpointError as e:
        out["refused"] = str(e)
    return out


def _three(rank, world_size, directory):
    """The 2-rank ZeRO-2 checkpoint on 3 ranks, sharded by optimizer state and by troupe.shard, K more steps;
    the troupe.shard model gathered on rank 0 only."""
    import troupe
    from troupe.reliability import checkpoint

    d = Path(directory)
    out = {}
    for regime in ("optimizer", "fsdp"):
        model, opt = _job(regime)
        checkpoint.load(checkpoint.latest(d / "two"), model, opt)
        _train(model, opt, range(N + M, N + M + K), rank, world_size)
        out[regime] = _params(model)
    out["rank0_only"] = troupe.full_state_dict(model, rank0_only=True)
    return out


def _reference(steps):
    model = _model()
    opt = _adamw(model)
    _train(model, opt, range(steps), 0, 1)
    return model.state_dict()


def _close(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], atol=TOL, rtol=0), (k, (got[k] - want[k]).abs().max())


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    d = tmp_path_factory.mktemp("shard-ckpt")
    manifest = run_world(_four, 4, str(d))[0]
    two = run_world(_two, 2, str(d))
    three = run_world(_three, 3, str(d))
    return manifest, two, three


def test_zero_checkpoint_is_saved_once_and_reshardable(worlds):
    manifest, _, _ = worlds
    assert manifest["world_size"] == 4 and manifest["layout"] == "sharded"
    assert manifest["per_rank_keys"] == [] and manifest["not_reshardable"] == []


@pytest.mark.parametrize("source,regime", RESUMES)
def test_four_ranks_resume_on_two_in_another_regime(worlds, source, regime):
    _, two, _ = worlds
    want = _reference(N + M)
    for rank_out in two:
        _close(rank_out[source, regime], want)


def test_two_ranks_resume_on_three(worlds):
    _, _, three = worlds
    want = _reference(N + M + K)
    for rank_out in three:
        _close(rank_out["optimizer"], want)
        _close(rank_out["fsdp"], want)
    _close(three[0]["rank0_only"], want)
    assert three[1]["rank0_only"] == {} and three[2]["rank0_only"] == {}


def test_another_model_is_refused_in_one_line(worlds):
    _, two, _ = worlds
    refused = two[0]["refused"]
    assert refused is not None and "\n" not in refused and "does not match the checkpoint" in refused
