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


ALLREDUCE = '''
import json, sys
import torch
import torch.nn.functional as F
import troupe

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
sgd = troupe.DistOpt(torch.optim.AdamW(model.parameters(), lr=0.05))  # the cluster's shard, from troupe run
rank = sgd.world.rank
x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
for _ in range(3):
    F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    sgd.step()
    sgd.zero_grad()
held = sum(p.numel() for group in sgd.param_groups for p in group["params"])
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"option": sgd.strategy.describe(), "held": held,
               "params": [p.detach().sum().item() for p in model.parameters()]}, f)
'''


def test_the_allreduce_framework_with_shard_is_a_sharded_distopt_and_hogwild_refuses(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(ALLREDUCE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "troupe.cli", "run", "-n", "2"]
    done = subprocess.run([*run, "--framework", "allreduce", "--shard", "optimizer", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["option"] for r in ranks] == ["plain, shard=optimizer"] * 2
    assert ranks[0]["held"] + ranks[1]["held"] == 8 * 16 + 16 + 16 + 1 and ranks[0]["params"] == ranks[1]["params"]
    refused = subprocess.run([*run, "--framework", "hogwild", "--shard", "optimizer", str(script), str(tmp_path)],
                             capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "shard optimizer runs in one worker group of co-located servers" in refused.stderr, refused.stderr
