"""The WORKLOADS registry: named models with their data and loss.

A workload builds its model (the same initial weights for a given seed, on every rank
and for every contestant), prepares batches up front (loading is never timed) and
computes a loss. The models are the checkout's own: the MNIST CNN of
``examples/mnist_cnn.py`` and the CIFAR-shaped ResNet-18 of ``benchmarks/resnet.py``,
loaded from the source tree, unchanged; "mlp" is a tiny model for tests.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import troupe.script.data
from troupe.bench.records import checkout_root

Batch = tuple[Tensor, Tensor]


def _load(relative: str) -> ModuleType:
    """Import a file of the checkout by path (examples and benchmarks are not packages)."""
    path = checkout_root() / relative
    name = "troupe_bench_" + path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class MLP(nn.Module):
    """784 -> 64 -> 10: a model small enough for tests."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(784, 64), nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model, its input shape, its default batch size and the data it can train on."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    shape: tuple[int, ...]
    """One sample's shape (C, H, W)."""
    batch_size: int
    """Default per-rank batch size."""
    datasets: tuple[str, ...] = ("synthetic",)
    """Data it can train on; the first is the default."""

    def model(self, seed: int = 0) -> nn.Module:
        """A fresh copy with the weights every copy built with this seed has."""
        torch.manual_seed(seed)
        return self.build()

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def batches(self, rank: int, world_size: int, batch_size: int, count: int, *, data: str | None = None,
                seed: int = 0) -> list[Batch]:
        """`count` distinct batches of this rank (cycled through by step index)."""
        data = data or self.datasets[0]
        if data not in self.datasets:
            raise ValueError(f"workload {self.name!r} trains on {list(self.datasets)}, not {data!r}")
        if batch_size < 1 or count < 1:
            raise ValueError(f"batch_size and count must be >= 1, got {batch_size} and {count}")
        if data == "mnist":
            x, y, _, _ = troupe.script.data.load_mnist()
            x, y = troupe.script.data.partition(x, y, rank, world_size)
        else:
            x, y = troupe.script.data.synthetic(count * batch_size, self.shape, seed=seed + rank)
        if len(x) < batch_size:
            raise ValueError(f"batch_size {batch_size} is larger than this rank's {len(x)} samples")
        g = torch.Generator().manual_seed(seed + rank)
        idx = torch.randperm(len(x), generator=g)
        per_epoch = len(x) // batch_size
        return [(x[idx[k * batch_size:(k + 1) * batch_size]].contiguous(),
                 y[idx[k * batch_size:(k + 1) * batch_size]].contiguous())
                for k in (i % per_epoch for i in range(count))]


def _cnn() -> nn.Module:
    return _load("examples/mnist_cnn.py").CNN()


def _resnet18() -> nn.Module:
    return _load("benchmarks/resnet.py").resnet18(num_classes=10)


WORKLOADS: dict[str, Workload] = {
    "cnn": Workload(name="cnn", description="the example's MNIST CNN (examples/mnist_cnn.py, 431,080 parameters)",
                    build=_cnn, shape=(1, 28, 28), batch_size=64, datasets=("mnist", "synthetic")),
    "resnet18": Workload(name="resnet18",
                         description="ResNet-18 with CIFAR shapes (benchmarks/resnet.py, 11.2M parameters, 3x32x32)",
                         build=_resnet18, shape=(3, 32, 32), batch_size=16),
    "mlp": Workload(name="mlp", description="a 784-64-10 MLP (tests)", build=MLP, shape=(1, 28, 28), batch_size=8),
}


def get(name: str) -> Workload:
    """The workload called `name` (ValueError listing the valid names otherwise)."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}") from None
