"""examples/gpt.py under every shard mode: the same training, to the last digit of its validation loss.

The example's `main()` runs four times in one 2-rank world (plain, ``shard="optimizer"``,
``"gradients"``, ``troupe.shard``), a tiny model for a few steps with accumulation and clipping;
sharding changes where the state lives, not the arithmetic, so every run ends at plain's loss.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.dist.world import run_world

ROOT = Path(__file__).resolve().parents[2]
MODES = ("none", "optimizer", "gradients", "parameters")


def train_every_mode(rank: int, world_size: int) -> dict:
    import torch

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    args = ["--steps", "4", "--eval-every", "4", "--warmup", "2", "--dim", "32", "--layers", "2", "--heads", "2",
            "--block-size", "32", "--batch-size", "2", "--accum", "2", "--clip", "0.5"]
    return {mode: gpt.main([*args, "--shard", mode]) for mode in MODES}


def test_every_shard_mode_trains_as_plain_does():
    losses = run_world(train_every_mode, 2, timeout=120)
    plain = losses[0]["none"]
    assert 0 < plain < 5.6  # below a uniform guess over 256 bytes (ln 256 = 5.55)
    for rank_losses in losses:
        for mode in MODES:
            assert rank_losses[mode] == pytest.approx(plain, abs=1e-5), mode
