"""``troupe run -n 4 --nworker-groups 2 --shard gradients`` with no framework: one real job of two synchronous
worker groups of two ranks, ZeRO-2 inside each group and the groups replicating (HSDP), and troupe.shard's
default groups taken from the same flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = '''
import json, sys
import torch
import torch.nn.functional as F
import troupe
from troupe.strategies.fsdp import SHARDED_BY

world = troupe.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
sgd = troupe.DistOpt(torch.optim.AdamW(model.parameters(), lr=0.05))  # shard and groups from troupe run
g = torch.Generator().manual_seed(world.rank)
x = torch.randn(32, 8, generator=g)
y = x.sum(1, keepdim=True)
losses = []
for _ in range(15):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    troupe.clip_grad_norm_(model.parameters(), 10.0)
    sgd.step()
    sgd.zero_grad()
    losses.append(loss.item())
held = sum(p.numel() for group in sgd.param_groups for p in group["params"])
fsdp = troupe.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
with open(f"{sys.argv[1]}/rank{world.rank}.json", "w") as f:
    json.dump({"groups": world.settings.groups, "option": sgd.strategy.describe(), "k": sgd.strategy.k,
               "across": sgd.strategy.across.world_size, "held": held, "losses": losses,
               "params": [p.detach().sum().item() for p in model.parameters()],
               "fsdp_groups": getattr(next(fsdp.parameters()), SHARDED_BY).groups}, f)
'''


def test_nworker_groups_without_a_framework_trains_sharded_inside_groups(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "troupe.cli", "run", "-n", "4", "--nworker-groups", "2",
                           "--shard", "gradients", str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 synchronous worker groups of 2 consecutive ranks" in done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    trainable = 8 * 16 + 16 + 16 + 1
    for res in ranks:
        assert (res["groups"], res["option"], res["k"], res["across"], res["fsdp_groups"]) == \
            (2, "plain, shard=gradients", 2, 2, 2)
        assert abs(res["held"] - trainable / 2) <= 1  # half the state: one bucket, padded to 2 chunks
        assert res["losses"][-1] < res["losses"][0] / 2  # it trains
        assert res["params"] == ranks[0]["params"]  # every rank ends each step with the same model
    assert ranks[0]["held"] + ranks[1]["held"] == trainable
