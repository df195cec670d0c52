"""Each communication-saving option still trains: 2 ranks, an MNIST subset, one world for all options."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.world import run_world

OPTIONS = [
    ("plain", None),
    ("fp16", None),
    ("bf16", None),
    ("partialUpdate", None),
    ("sparseTopK", 0.05),
    ("sparseThreshold", 2e-3),
]
TRAIN, TEST, BATCH, EPOCHS = 4096, 1000, 32, 2


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 5)
        self.fc1 = nn.Linear(8 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(y.flatten(1))))


def train_all(rank, world_size):
    import troupe

    train_x, train_y, test_x, test_y = troupe.data.load_mnist()
    x, y = troupe.data.partition(train_x[:TRAIN], train_y[:TRAIN], rank, world_size)
    tx, ty = test_x[:TEST], test_y[:TEST]
    out = {}
    for option, spars in OPTIONS:
        torch.manual_seed(0)
        model = SmallCNN()
        opt = troupe.DistOpt(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            compression=troupe.CompressionConfig(chunk_size=4096),
        )
        opt.sync_parameters(model)
        start, ratios = time.perf_counter(), []
        g = torch.Generator().manual_seed(rank)
        for _ in range(EPOCHS):
            perm = torch.randperm(len(x), generator=g)
            for b in range(len(x) // BATCH):
                sel = perm[b * BATCH : (b + 1) * BATCH]
                opt.update(F.cross_entropy(model(x[sel]), y[sel]), option, spars)
                ratios.append(opt.last_step_stats.get("ratio", 1.0))
        with torch.no_grad():
            acc = (model(tx).argmax(1) == ty).float().mean().item()
        out[option] = {"acc": acc, "ratio": sum(ratios) / len(ratios), "seconds": time.perf_counter() - start}
    return out


def test_every_option_reaches_the_accuracy_bar():
    results = run_world(train_all, 2, timeout=180)
    for option, _ in OPTIONS:
        accs = [r[option]["acc"] for r in results]
        print(option, results[0][option])
        assert min(accs) > 0.85, (option, accs)
    # the options really sent less than dense fp32
    assert results[0]["fp16"]["ratio"] < 0.55
    assert results[0]["sparseTopK"]["ratio"] < 0.15
    assert results[0]["partialUpdate"]["ratio"] < 0.2
    assert results[0]["sparseThreshold"]["ratio"] < 1.0
