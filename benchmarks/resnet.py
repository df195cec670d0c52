"""A ResNet-18 for 32x32 images (torchvision is not a dependency): 11.2M parameters, BatchNorm."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (a 1x1 convolution when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """The CIFAR variant of ResNet (3x3 stem, no max-pool), as in the usual CIFAR-10 recipes."""

    def __init__(self, blocks: tuple[int, ...] = (2, 2, 2, 2), num_classes: int = 10, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, stride=2 if i > 0 and j == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        y = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1))


def resnet18(num_classes: int = 10) -> ResNet:
    """ResNet-18: four stages of two basic blocks, widths 64-512."""
    return ResNet((2, 2, 2, 2), num_classes)
