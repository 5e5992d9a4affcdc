"""A user's own MLP file for 3D tests: residual blocks of fc1 -> GELU -> fc2 (biases on both), which
the traced graph splits column- then row-wise, and a classifier head that stays whole."""

from __future__ import annotations

import torch
from torch import nn

WIDTH, HIDDEN, BLOCKS, CLASSES = 32, 64, 4, 10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def model() -> nn.Module:
    return MLP()


def example_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, WIDTH)
