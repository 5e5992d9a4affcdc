"""A model of equal wide layers: a stage is a small share of it, so what verify holds is measurable."""

from __future__ import annotations

import torch
from torch import nn

WIDTH, LAYERS = 2048, 24


def wide() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)), nn.Linear(WIDTH, 10))


def example_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, WIDTH)
