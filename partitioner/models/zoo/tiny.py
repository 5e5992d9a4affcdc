"""Small models that exercise the graph shapes pipelines care about, fast enough for unit tests."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TinyCNN", "TinyMLP", "TinySkip", "tiny_cnn", "tiny_mlp", "tiny_skip"]


class TinyMLP(nn.Module):
    """A straight chain: the simplest pipeline."""

    def __init__(self, width: int = 32, inputs: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, width)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(width, width)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))
        return out


class TinyCNN(nn.Module):
    """Conv stem, one residual block (a fork and a join), pooling, flatten, classifier."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv_a = nn.Conv2d(channels, channels, 3, padding=1)
        self.relu_a = nn.ReLU()
        self.conv_b = nn.Conv2d(channels, channels, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn(self.stem(x)))
        x = x + self.conv_b(self.relu_a(self.conv_a(x)))
        x = self.pool(x).flatten(1)
        out: torch.Tensor = self.fc(x)
        return out


class TinySkip(nn.Module):
    """A tensor (``early``) that skips three layers: a cut in between must send it across stages."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.l1 = nn.Linear(width, width)
        self.l2 = nn.Linear(width, width)
        self.l3 = nn.Linear(width, width)
        self.l4 = nn.Linear(width, width)
        self.act = nn.Tanh()
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        early = self.act(self.l1(x))
        y = self.l3(torch.relu(self.l2(early)))
        y = self.l4(y) + early
        out: torch.Tensor = self.head(y)
        return out


def tiny_mlp() -> TinyMLP:
    """Linear-ReLU-Linear-ReLU-Linear on 16 features, 10 classes."""
    return TinyMLP()


def tiny_cnn() -> TinyCNN:
    """Residual CNN on 3-channel images (16x16 by default), 10 classes."""
    return TinyCNN()


def tiny_skip() -> TinySkip:
    """Chain of linears with a skip over three layers, 16 features, 10 classes."""
    return TinySkip()
