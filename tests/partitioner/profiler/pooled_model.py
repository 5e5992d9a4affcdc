"""A small VGG-like model (convolution, ReLU, convolution, ReLU, max-pool, twice), for the test that a
reused layer counts its saved tensors as a measured one would: each pair's second ReLU is the first's
twin, and the pool after it reads (and saves) the tensor that ReLU saved."""

from __future__ import annotations

import torch
from torch import nn


def _pair(cin: int, cout: int) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    ]


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(*_pair(3, 8), *_pair(8, 8))
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def pooled() -> nn.Module:
    return Pooled()


def example_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 3, 16, 16, generator=torch.Generator().manual_seed(0))
