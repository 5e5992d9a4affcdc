"""A model whose forward makes tensors of its own (``torch.tensor``, a list used as an index), called
by keyword so torch.export traces it and lifts them into graph attributes no module holds."""

from __future__ import annotations

import torch
from torch import nn


class Lifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = self.b(h[:, [0, 2, 1, 3]] * torch.tensor(2.0))
        return self.c(torch.tanh(h) + torch.tensor([0.5, -0.5, 0.25, 0.0]))


def make() -> Lifted:
    return Lifted()


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch_size, 4)}
