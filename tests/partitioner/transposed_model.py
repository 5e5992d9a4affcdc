"""Layers that read their weight through ``.T`` (as Falcon's ``FalconLinear`` does), not ``F.linear``."""

from __future__ import annotations

import torch
from torch import nn


class TransposedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


def transposed() -> nn.Sequential:
    return nn.Sequential(*(TransposedLinear(96, 96) for _ in range(4)), nn.Linear(96, 10))


def example_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 96)
